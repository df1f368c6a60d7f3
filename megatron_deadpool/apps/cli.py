"""``deadpool`` command line: launch | drain | demo | soak | bench | plan | sim | report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from ..base.errors import DeadpoolError
from ..base.faults import KINDS
from . import drain, sim_plot


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _split(argv: List[str]):
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="deadpool", description="hot-swap fault tolerance for Megatron training")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    _add_launch(sub.add_parser("launch", help="start workers grouped into nodes "
                               "(usage: deadpool launch [options] -- <trainer flags>)"))
    _add_demo_and_soak(sub)
    drain.add_parser(sub)
    _add_bench(sub)
    _add_plan(sub.add_parser("plan", help="optimizer-shard bytes per rank and mirror host "
                             "memory per node of a preset; refuses a mirror that does not fit"))
    sim_plot.add_arguments(sub.add_parser("sim", help="goodput model at scale: hot swap vs checkpoint/restart "
                            "vs in-process restart, spare count, validation against bench "
                            "recovery (docs/simulator.md)"))
    return p


def _add_plan(pp) -> None:
    pp.add_argument("--preset", required=True,
                    help="a name in configs/presets (gpt-1.3b, gpt-7b, gpt-13b, gpt-65b) or a "
                         "path to a preset JSON file")
    pp.add_argument("--system", required=True, choices=["perlmutter", "vista"])
    pp.add_argument("--nodes", type=int, default=None, help="active nodes (default: preset's)")
    pp.add_argument("--replicas", type=int, default=1, choices=[1, 2],
                    help="K, the buddy copies the job will use (--deadpool-replicas)")
    pp.add_argument("--host-fraction", type=float, default=None,
                    help="share of host memory the mirror may use (default 0.75)")
    pp.add_argument("--json", action="store_true", help="print the table as JSON")
    pp.add_argument("--flags", action="store_true",
                    help="print only the trainer flags of this layout (after the checks)")


def _add_launch(lp) -> None:
    lp.add_argument("--nodes", type=int, required=True, help="active nodes")
    lp.add_argument("--procs-per-node", type=int, required=True)
    lp.add_argument("--spare-nodes", type=int, default=0, help="standby nodes (need --deadpool)")
    lp.add_argument("--node-rank", type=int, default=None,
                    help="run as the agent of this one node (multi-node, e.g. under srun); "
                         "node 0 hosts the coordinator. Omit to simulate all nodes locally")
    lp.add_argument("--master-addr", default="127.0.0.1")
    lp.add_argument("--master-port", type=int, default=None,
                    help="torch rendezvous port; the coordinator store uses port+1 "
                         "(default: a free port locally, 29500 multi-node)")
    lp.add_argument("--summary-json", default=None, metavar="FILE")
    lp.add_argument("--script", default=None, metavar="PATH",
                    help="entry point to run instead of the reference trainer "
                         "(e.g. Megatron-LM's pretrain_gpt.py)")
    lp.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="cpu: CPU mode (with --script: the package's CPU mode, gloo and the "
                         "CPU-only Megatron-LM flags of docs/cpu-mode.md); default: the "
                         "trainer's own choice")
    lp.add_argument("--share-gpu", action="store_true",
                    help="with --device cuda: run more processes than GPUs, each process its "
                         "own NCCL host on the socket transport (a test layout for one GPU, "
                         "not a production one; launch/gpus.py)")
    lp.add_argument("--inject", action="append", default=[], metavar="SPEC",
                    help="fault to inject, repeatable: kill:node=1@iter=12, "
                         "kill:rank=5@iter=7,phase=optimizer, stop:rank=3@iter=9 (the form "
                         "and the phases: docs/usage.md). The kinds: "
                         + " ".join(f"{k.line()}." for k in KINDS.values()))
    lp.add_argument("--results-dir", default=None, metavar="DIR",
                    help="per-rank results and loss log (default: a temp dir)")
    lp.add_argument("--join-as-spare", action="store_true",
                    help="add one spare node to a running job (give its --master-addr, "
                         "--master-port, --nodes, --procs-per-node, trainer flags, and its "
                         "DEADPOOL_TOKEN)")


def _add_demo_and_soak(sub) -> None:
    dp = sub.add_parser("demo", help="CPU hot-swap demo: kill a node, swap in a spare, "
                        "compare with a failure-free replay")
    dp.add_argument("--summary-json", default=None, metavar="FILE")
    dp.add_argument("--train-iters", type=int, default=30)
    dp.add_argument("--kill-iter", type=int, default=12)
    dp.add_argument("--kill-node", type=int, default=1)
    dp.add_argument("--no-replay", action="store_true",
                    help="skip the failure-free replay (then bitwise_equal is not checked)")
    dp.add_argument("--verbose", action="store_true", help="show every worker's output")

    sp = sub.add_parser("soak", help="one long CPU job with a seeded random schedule of "
                        "recoverable faults; dead processes return as spares; bitwise check")
    sp.add_argument("--failures", type=int, default=25)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--gap", type=int, default=10, help="iterations between faults (+-2)")
    sp.add_argument("--summary-json", default=None, metavar="FILE")

    rp = sub.add_parser("report", help="draw a run's timeline (ranks, iterations, recovery "
                        "phases, promoted spares) and its loss against the failure-free run")
    rp.add_argument("events", metavar="EVENTS.jsonl", help="written by --deadpool-events")
    rp.add_argument("--summary", default=None, metavar="S.json",
                    help="a launch or demo summary (losses, faults, reference losses)")
    rp.add_argument("-o", "--output", default="timeline.png", metavar="PNG")


def _add_bench(sub) -> None:
    bp = sub.add_parser("bench", help="benchmarks")
    bsub = bp.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    bo = bsub.add_parser("overhead", help="step time with the mirror off vs on, interleaved "
                         "(usage: deadpool bench overhead [--json F] -- <trainer flags>)")
    bo.add_argument("--json", default=None, metavar="FILE")
    bo.add_argument("--rounds", type=int, default=3, help="off/on pairs, interleaved")
    bo.add_argument("--nodes", type=int, default=4)
    bo.add_argument("--procs-per-node", type=int, default=2)
    bo.add_argument("--in-run-iters", type=int, default=150,
                    help="also measure on/off in alternating blocks inside one job of this "
                         "many iterations (0: skip)")
    br = bsub.add_parser("recovery", help="per-phase recovery time of a node kill against "
                         "world size, and a hang's detection (-- <more trainer flags>)")
    br.add_argument("--json", default=None, metavar="FILE")
    br.add_argument("--repeats", type=int, default=3, help="runs per world size")
    br.add_argument("--world-sizes", default="4,8,16", metavar="W,W,...",
                    help="processes (multiples of 4: TP2 x PP2 x DP W/4); default %(default)s")
    br.add_argument("--no-hang", action="store_true", help="skip the SIGSTOP run")
    br.add_argument("--counts", action="store_true", help="also count each phase's work per "
                    "survivor (groups, connections, store operations, messages, bytes) and "
                    "fit each count against W (--deadpool-count-work); the unit costs "
                    "are timed first (bench units)")
    br.add_argument("--light", action="store_true", help="a model of a few KB, the same "
                    "layout, membership, mirror and restore (W = 32, 64 fit on 2 cores)")
    from .bench_units import add_arguments as add_units
    add_units(bsub.add_parser("units", help="what one unit of each counted kind of recovery "
                              "work costs (a store operation, a gloo connection, a group), "
                              "timed alone by 2 processes; run it on an idle machine"))
    bg = bsub.add_parser("gpu", help="the NCCL hot swap on one GPU that hosts the whole job "
                         "(--share-gpu): both trainers, failure-free and node 1 killed; "
                         "bitwise and the phases (scripts/gpu_swap_check.sh runs it)")
    bg.add_argument("--out", required=True, metavar="DIR",
                    help="gpu_swap.json, gpu_swap.log and each run's files go here")
    bg.add_argument("--megatron-lm", default=None, metavar="DIR",
                    help="a patched Megatron-LM tree (scripts/apply_patches.sh); without "
                         "it only the reference trainer runs")
    bg.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting cases after this many seconds (default %(default)s)")
    bg.add_argument("--case-cap-s", type=float, default=None,
                    help="one case's own limit; a case past it failed (default: "
                         "bench_gpu.CASE_CAP_S)")
    bg.add_argument("--log", default=None, metavar="FILE",
                    help="append every launcher's output here (default: OUT/gpu_swap.log)")
    bg.add_argument("--rehearse-cut", action="store_true",
                    help="a rehearsal: the last case gets a fraction of a finished case's "
                         "time, so the budget's cut is shown")
    bg.add_argument("--cases", default=None, metavar="A,B", help="only these cases")
    bg.add_argument("--commit", default=None, help="the commit, where git is not there")
    bg.add_argument("--dry-run", action="store_true",
                    help="print what would run and write the plan; runs nothing")
    bg.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same cases in CPU mode with gloo, to rehearse the script "
                         "where no GPU is")
    from .bench_peers import add_arguments as add_peers

    add_peers(bsub.add_parser("peers", help="DeadPool against NVRx and a whole-job relaunch "
                              "on the same Megatron-LM job, one injector (docs/peers.md; "
                              "usage: deadpool bench peers [options] [-- <more trainer "
                              "flags>])"))


def _run_launch(args, rest: List[str]) -> int:
    from ..launch.launcher import LaunchOptions, run

    opts = LaunchOptions(
        nodes=args.nodes, procs_per_node=args.procs_per_node,
        spare_nodes=args.spare_nodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port,
        summary_json=args.summary_json, script=args.script, inject=args.inject,
        results_dir=args.results_dir, trainer_argv=rest, device=args.device,
        share_gpu=args.share_gpu, join_as_spare=args.join_as_spare)
    summary = run(opts)
    if summary["ok"] and args.join_as_spare:
        print(f"[launch] spare node {summary['node']} left the job: "
              f"{summary['reason']}", flush=True)
        return 0
    if summary["ok"] and summary.get("replaced_here"):
        print(f"[launch] this node's processes were replaced on other nodes; the job "
              f"ended: {summary['reason']}", flush=True)
        return 0
    if summary["ok"]:
        print(f"[launch] completed {summary['completed_iters']} iterations; "
              f"final_state_sha256 {summary['final_state_sha256']}", flush=True)
        return 0
    if summary.get("startup_error"):  # the workers' own error, not a failed node
        print(f"deadpool: error: {summary['startup_error']}", file=sys.stderr, flush=True)
        return 1
    print(f"[launch] error: {summary['error'] or 'the job did not complete'}",
          file=sys.stderr, flush=True)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = _split(argv)
    args = build_parser().parse_args(own)
    try:
        if args.cmd == "launch":
            return _run_launch(args, rest)
        if args.cmd == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.cmd == "soak":
            from .soak import run_soak

            if args.failures < 1 or args.gap < 5:
                raise DeadpoolError("--failures must be >= 1 and --gap >= 5")
            out = run_soak(args.failures, args.seed, args.gap, args.summary_json)
            return 0 if out["bitwise_equal"] and out["failures_injected"] == args.failures \
                else 1
        if args.cmd == "drain":
            return drain.run(args)
        if args.cmd == "plan":
            return _run_plan(args)
        if args.cmd == "sim":
            return _run_sim(args)
        if args.cmd == "report":
            from .report import draw

            print(f"wrote {draw(args.events, args.output, args.summary)}")
            return 0
        if args.cmd == "bench":
            return _run_bench(args, rest)
    except DeadpoolError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 2


def _run_bench(args, rest: List[str]) -> int:
    from . import bench

    if args.bench == "gpu":
        from .bench_gpu import CASE_CAP_S, run as gpu

        r = gpu(args.out, args.megatron_lm, args.budget_s, args.dry_run, args.commit,
                args.cases.split(",") if args.cases else None, args.device,
                args.case_cap_s or CASE_CAP_S, args.log, args.rehearse_cut)
        return 0 if args.dry_run or (r["bitwise"] and r["deterministic"] is not False) else 1
    if args.bench == "peers":
        from .bench_peers import run as peers

        runs = peers(args, rest)["runs"]
        return 0 if runs and all(r["outcome"] == "done" for r in runs) else 1
    if args.bench == "overhead":
        result = bench.overhead(rest, rounds=args.rounds, nodes=args.nodes,
                                procs_per_node=args.procs_per_node,
                                in_run_iters=args.in_run_iters)
    elif args.bench == "units":
        from .bench_units import units

        result = units(rounds=args.rounds, n=args.n)
    else:
        from .bench_recovery import recovery

        result = recovery(repeats=args.repeats, hang=not args.no_hang,
                          world_sizes=_int_list(args.world_sizes, "--world-sizes"),
                          counts=args.counts, light=args.light, extra=rest)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result.get("failed_runs") else 0


def _int_list(text: str, flag: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DeadpoolError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _preset_path(name: str) -> Path:
    if os.path.exists(name):
        return Path(name)
    base = Path(os.environ.get("DEADPOOL_PRESETS")
                or Path(__file__).resolve().parents[2] / "configs" / "presets")
    path = base / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in base.glob("*.json"))
        raise DeadpoolError(f"no preset {name!r} in {base} (known: {', '.join(known)})")
    return path


def _run_sim(args) -> int:
    from ..base import planning
    from . import sim, sim_plot

    fields = {f.name for f in sim.dataclasses.fields(sim.SimConfig)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    kw["gpus"] = tuple(args.gpus)
    if args.preset and args.model_params is None:
        kw["model_params"] = float(planning.total_params(
            json.loads(_preset_path(args.preset).read_text())["model"]))
    cfg = sim.SimConfig(**kw)
    from .sim_scale import DATA, MEASURED_FILE

    measured = args.measured or str(DATA / "bench_recovery.json" if args.law == "fit"
                                    or args.peers else MEASURED_FILE)
    law = args.law or sim.default_law(measured)
    if args.peers:
        from . import sim_peers

        result = sim_peers.project(cfg, measured, sim_peers.load_pieces(args.peers))
        print("\n".join(sim_peers.format_table(result)))
    else:
        result = sim.simulate(cfg, measured, law=law, units=args.units,
                              log=lambda m: print(m, file=sys.stderr))
        print("\n".join(sim_plot.format_table(result)))
    for w in ([] if args.peers else sim_plot.warnings(result)):
        print(w, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {sim_plot.plot(cfg, measured, args.plot)}")
    return 0


def _run_plan(args) -> int:
    from ..base import planning

    preset = json.loads(_preset_path(args.preset).read_text())
    try:
        fraction = planning.DEFAULT_HOST_FRACTION if args.host_fraction is None \
            else args.host_fraction
        table = planning.plan(preset, args.system, args.nodes, fraction)
    except planning.PlanError as exc:
        raise DeadpoolError(str(exc)) from None
    reason = planning.refusal(table, args.replicas)
    if args.flags:
        if reason:
            raise DeadpoolError(f"refused: {reason}")
        lay = planning.layout_for(preset, planning.SYSTEMS[args.system], args.nodes)
        print(" ".join(planning.trainer_flags(preset, lay)))
        return 0
    print(json.dumps(table, indent=2) if args.json else "\n".join(planning.format_table(table)))
    if reason:
        print(f"deadpool plan: refused: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
