"""``deadpool sim`` output: the readable table and the goodput-vs-scale plot (matplotlib is
imported lazily, inside ``plot``: it is in the ``test`` and ``report`` extras only)."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

from . import sim, sim_measured
from .sim_scale import MEASURED_FILE
from ..base.config import GradStats, values
from ..base.errors import DeadpoolError

LABELS = {"hotswap": "DeadPool hot swap", "checkpoint_restart": "checkpoint/restart",
          "inprocess_restart": "in-process restart + checkpoint reload"}


def format_table(result: Dict) -> List[str]:
    a = result["assumptions"]
    lines = [f"model {a['model_params'] / 1e9:g} B params, TP{a['tp']} x PP{a['pp']}, "
             f"{a['gpus_per_node']} GPUs/node, node MTBF {a['node_mtbf_hours']:g} h, "
             f"link {a['link_gbps']:g} Gb/s, iteration {a['iteration_s']:g} s",
             f"{'GPUs':>7} {'fail/day':>8} {'ckpt min':>8}  " + "  ".join(
                 f"{s[:18]:>18}" for s in sim.STRATEGIES) + "   (goodput | lost s/failure)"]
    for g, ps in result["per_scale"].items():
        cells = [f"{result['goodput'][s][g]:7.4f} |{result['lost_per_failure_s'][s][g]:8.1f}"
                 for s in sim.STRATEGIES]
        lines.append(f"{g:>7} {ps['failures_per_day']:8.2f} "
                     f"{ps['checkpoint_interval_min']:8.1f}  " + "  ".join(
                         f"{c:>18}" for c in cells))
    sp = result["spares"]
    lines.append(f"spares: {sp['spare_nodes']} spare node(s) at {sp['gpus']} GPUs give "
                 f"P(never running out in {sp['window_hours']:g} h, {sp['window']}) = "
                 f"{sp['probability']:.4f} >= {sp['target_probability']}")
    good = result["goodput"]
    gain = {g: good["hotswap"][g] - max(good[s][g] for s in sim.STRATEGIES if s != "hotswap")
            for g in sp["per_scale"]}
    lines.append("  spare nodes for it and the machine they leave idle: " + ", ".join(
        f"{g} GPUs {v['spare_nodes']} ({v['idle_share']:.2%})"
        for g, v in sp["per_scale"].items()) + "; hot swap's goodput gain over the best "
        "baseline: " + ", ".join(f"{g} GPUs {x:+.2%}" for g, x in gain.items()))
    lines.append(f"  repairs: {a['repair_source']}" if sp["repair_hours"] else
                 "  repairs: none (--repair-hours 0: a failed node never returns in the job)")
    lines.append(f"  correlated failures: {sp['domain_share']:.1%} of the failure events take "
                 f"a whole domain of {sp['domain_nodes']} nodes at once ({a['domain_source']})"
                 if sp["domain_nodes"] > 1 and sp["domain_share"] > 0 else
                 "  correlated failures: none (every failure takes one node; --domain-share)")
    up = sim.UPPER_DOMAIN
    lines.append(f"  with the upper end, {up[1]:.1%} of the events taking a rack of {up[0]} "
                 f"nodes ({sim.DOMAIN_SOURCE}): " + ", ".join(
                     f"{g} GPUs {v['spare_nodes_upper_domain']} "
                     f"({v['idle_share_upper_domain']:.2%})" for g, v in sp["per_scale"].items()))
    lines.append("scaling law: " + ", ".join(
        f"{ph} {law['form']}" for ph, law in result["scaling_law"].items()))
    for ph, law in result["scaling_law"].items():  # the count law: where growth comes from
        if "counts" in law:
            lines.append(f"  {ph}: {law['constant_s']:.4f} s + " + " + ".join(
                f"{k} {c['form']} x {law['unit_s'][k]:.3g} s"
                for k, c in law["counts"].items()))
    if result.get("law") == "scale":
        lines += _scale_lines(result)
    lines.append("validation (leave-one-out, predicted vs measured total):")
    for v in result["validation"]:
        lines.append(f"  W={v['world_size']:<4} {v['predicted_total_s']:.3f} s vs "
                     f"{v['measured_total_s']:.3f} s  error {v['rel_error']:+.1%}  "
                     f"(in-sample {v['in_sample_rel_error']:+.1%})"
                     + ("" if v["within_25pct"] else "  OUTSIDE 25%"))
    return lines


def _scale_lines(result: Dict) -> List[str]:
    """The law at scale: each phase's terms at the largest GPU count, megatron-core's groups
    the busiest survivor rebuilds there, every unit cost with its status and source."""
    top = str(max(int(g) for g in result["plans"]))
    plan = result["plans"][top]
    lines = [f"at {top} GPUs (megatron-core {plan['megatron_core']}'s plan): the busiest "
             "survivor rebuilds " + ", ".join(f"{g['megatron']} ({g['size']} ranks)"
                                              for g in plan["busiest_survivor_groups"])
             + f"; {plan['rebuilt_members_total']} members in the "
             f"{plan['groups_with_a_dead_rank']} groups that held a lost rank"]
    o = result["grad_stats_other"]
    lines.append(f"  grad stats: {result['assumptions']['grad_stats']} (--grad-stats; the "
                 "job's --deadpool-grad-stats, whose training default is 'world': bitwise to "
                 f"the unpatched script); with '{o['grad_stats']}' hot swap loses "
                 + ", ".join(f"{g} GPUs {v:.1f} s" for g, v in o["lost_per_failure_s"].items())
                 + " per failure")
    for ph, law in result["scaling_law"].items():
        terms = law["terms_at"][top]
        lines.append(f"  {ph}: " + " + ".join(f"{k} {v:.3g} s" for k, v in terms.items()))
    lines.append("the job's one store while training (fraction of its time; 1 or more: it "
                 "cannot keep up): " + ", ".join(
                     f"{g} GPUs {u:.2f}" for g, u in result["steady_store_utilization"].items()))
    lines.append("unit costs at scale (every assumption; docs/simulator.md):")
    for u in result["units_at_scale"]:
        lines.append(f"  {u['name']} = {u['value']:.4g} {u['unit']} [{u['status']}]: "
                     f"{u['source']}")
    lines.append("what the code is assumed to do at scale:")
    for b in result.get("behaviour_at_scale", []):
        lines.append(f"  {b['name']} [{b['status']}]: {b['text']}")
    return lines


def warnings(result: Dict) -> List[str]:
    out = [f"deadpool sim: warning: W={v['world_size']} prediction is off by "
           f"{v['rel_error']:+.1%} (outside 25%)" for v in result["validation"]
           if not v["within_25pct"]]
    out += [f"deadpool sim: warning: at {g} GPUs the job's one store cannot serve the "
            f"control plane while training ({u:.1f}x its capacity): the projection assumes "
            "it can" for g, u in result.get("steady_store_utilization", {}).items() if u >= 1]
    out += [f"deadpool sim: note: W={v['world_size']} (outside the fit, oversubscribed "
            f"{v['oversubscription']:g}x) is predicted {v['rel_error']:+.1%} off"
            for v in result.get("validation_outside_fit", []) if not v["within_25pct"]]
    if result.get("measured_phases_missing"):
        out.append(f"deadpool sim: warning: {result['measured_file']} has no "
                   f"{', '.join(result['measured_phases_missing'])} phase (measured before it "
                   "existed): counted as 0 s")
    if result.get("measured_placeholder"):
        out.append(f"deadpool sim: warning: {result['measured_file']} is a placeholder, not "
                   "a measurement (replace it with `deadpool bench recovery --json`)")
    return out


def sweep_gpus(cfg: sim.SimConfig, lo: int = 512, hi: int = 100000, n: int = 40) -> List[int]:
    """Log-spaced GPU counts from lo to hi, rounded to a valid multiple for the layout."""
    step = math.lcm(cfg.gpus_per_node, cfg.tp * cfg.pp)
    pts = {max(step, round(lo * (hi / lo) ** (i / (n - 1)) / step) * step) for i in range(n)}
    return sorted(pts | {g for g in sim.DEFAULT_GPUS if g % step == 0})


def plot(cfg: sim.SimConfig, measured_path, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DeadpoolError("--plot needs matplotlib: pip install -e .[report]") from None
    gpus = sweep_gpus(cfg)
    scfg = dataclasses.replace(cfg, gpus=tuple(gpus))
    measured = sim_measured.load_measured(measured_path)
    laws = sim.phase_laws(measured, scfg)
    at = [sim.strategies_at(scfg, laws, g) for g in gpus]
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for s in sim.STRATEGIES:
        ax.plot(gpus, [x["goodput"][s] for x in at], marker=".", label=LABELS[s])
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("expected goodput (useful time / wall time)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left")
    a = cfg.assumptions()
    ckpt = (f"every {a['checkpoint_interval_min']:g} min" if a["checkpoint_interval_min"]
            else "at Young's optimum interval")
    caption = (f"Assumptions: {a['model_params'] / 1e9:g} B params, TP{cfg.tp} PP{cfg.pp}, "
               f"{cfg.gpus_per_node} GPUs/node, node MTBF {a['node_mtbf_hours']:.0f} h, "
               f"iteration {cfg.iteration_s:g} s (half redone per failure), link "
               f"{cfg.link_gbps:g} Gb/s per GPU;\nmirror overhead {cfg.mirror_overhead:g}, "
               f"checkpoint write {cfg.checkpoint_write_s:g} s {ckpt}, restart "
               f"{cfg.restart_cost_s:g} s, in-process restart {cfg.inprocess_restart_s:g} s "
               f"+ reload {cfg.checkpoint_load_s:g} s;\nhot swap phases: the count law or the fit "
               f"on the CPU-measured recovery phases, extrapolated (not the law at scale "
               f"of the table, which needs a plan per GPU count; docs/simulator.md)")
    fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    fig.subplots_adjust(bottom=0.24)
    ax.set_title("deadpool sim: goodput against scale" + (
        "\n(recovery phases from a PLACEHOLDER file, not a measurement)"
        if measured["placeholder"] else ""))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _add_job_arguments(sp, d) -> None:
    """How the simulated job runs DeadPool."""
    sp.add_argument("--grad-stats", choices=values(GradStats), default=d.grad_stats,
                    help="the job's --deadpool-grad-stats (default %(default)s: no group of "
                    "every rank is made at a recovery, the setting for a job at scale; the "
                    "other is projected beside it)")


def add_arguments(sp) -> None:
    """``deadpool sim``'s options (defaults from ``SimConfig``)."""
    from .sim import SimConfig as C

    d = C()
    flt = (("--node-mtbf-hours", None, "default: Llama 3 per-GPU MTBF / GPUs per node"),
           ("--target-probability", d.target_probability, "of never running out of spares"),
           ("--job-hours", d.job_hours, "job length (the spare window)"),
           ("--repair-hours", d.repair_hours, "a failed node returns to the spare pool "
                                              "after this long (0: never, within the job)"),
           ("--link-gbps", d.link_gbps, "inter-node bandwidth per GPU, Gb/s"),
           ("--checkpoint-interval-min", None, "baselines' interval (default: Young's "
                                               "optimum sqrt(2 x write x MTBF) per scale)"),
           ("--checkpoint-write-s", d.checkpoint_write_s, "blocking checkpoint write"),
           ("--checkpoint-load-s", d.checkpoint_load_s, "checkpoint reload (in-process)"),
           ("--restart-cost-s", d.restart_cost_s, "requeue + init + checkpoint load"),
           ("--inprocess-restart-s", d.inprocess_restart_s, "in-process restart itself"),
           ("--iteration-s", d.iteration_s, "one training iteration"),
           ("--mirror-overhead", d.mirror_overhead, "hot swap steady step-time fraction"),
           ("--measured-link-gbps", d.measured_link_gbps, "the measured runs' transport"))
    sp.add_argument("--gpus", type=int, nargs="+", default=list(d.gpus))
    sp.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    sp.add_argument("--model-params", type=float, default=None,
                    help=f"parameters (default {d.model_params:g}, or the preset's)")
    sp.add_argument("--preset", default=None, help="take the model size from a preset")
    sp.add_argument("--tp", type=int, default=d.tp)
    sp.add_argument("--pp", type=int, default=d.pp)
    _add_job_arguments(sp, d)
    sp.add_argument("--spare-nodes", type=int, default=None,
                    help="report P(never running out) with this many spare nodes")
    sp.add_argument("--domain-nodes", type=int, default=d.domain_nodes,
                    help="nodes of a failure domain (a rack) that a correlated failure takes "
                         f"at once (default {d.domain_nodes}: an NVL72 rack; 1: none)")
    sp.add_argument("--domain-share", type=float, default=d.domain_share,
                    help="share of the failure events that take a whole domain (default "
                         f"{d.domain_share:g}: none; Llama 3's switch/cable events were 35 of "
                         "419, 0.0835, an upper end)")
    for flag, default, what in flt:
        sp.add_argument(flag, type=float, default=default, help=f"{what} (default {default})")
    sp.add_argument("--measured", default=None, metavar="R.json",
                    help="bench recovery --json output (default: docs/data/"
                    f"{MEASURED_FILE.name} with --law scale, counts or auto; "
                    "docs/data/bench_recovery.json with --law fit)")
    sp.add_argument("--law", choices=sim.LAWS, default=None,
                    help="each recovery phase against W: 'scale' (the default where the "
                    "measured runs have counts, else 'auto'), megatron-core's "
                    "group plan at each W and the count law, x unit costs at scale, every one "
                    "listed with its source (apps/sim_scale.py); 'counts', the work a survivor "
                    "does (bench recovery --counts) x unit costs, extrapolated; 'fit', the "
                    "phase time fitted directly; 'auto': counts when the file has them")
    sp.add_argument("--units", default=None, metavar="U.json",
                    help="unit costs timed one by one (deadpool bench units --json); default: "
                    "those the measured file carries, else fitted to its phase times")
    sp.add_argument("--peers", default=None, metavar="peers.json",
                    help="bench peers' result: project each peer system beside DeadPool "
                         "from its measured restart pieces (docs/peers.md)")
    sp.add_argument("--json", default=None, metavar="FILE")
    sp.add_argument("--plot", default=None, metavar="F.png")
