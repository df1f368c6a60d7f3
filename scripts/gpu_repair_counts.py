#!/usr/bin/env python3
"""Issue 51 on NCCL, prepared for a lent GPU (never run on one yet): what repairing the
communicators costs per survivor, by option, at W = 8, 16, 32 ranks on ONE GPU in the
shared-GPU mode (each process its own NCCL_HOSTID, the socket transport on loopback:
launch/gpus.py SHARED_GPU_NCCL; a test layout, not a production one).

    python scripts/gpu_repair_counts.py --world-sizes 8,16,32 --out DIR [--device cpu] [--dry-run]

Per W: W ranks + 2 spares. The ranks build TP2 x PP2 x DP W/4's groups (tensor, data,
pipeline, tensor-and-data: megatron's order tp-dp-pp) plus the world, and run one
all-reduce on each (NCCL connects lazily). Node 1 (ranks 2 and 3) exits at once. Each
survivor then, timed and counted:
  * kept: every group without rank 2 or 3, checked with an all-reduce;
  * shrunk: every group holding 2 or 3, ``torch.distributed.shrink_group(..., SHRINK_ABORT)``
    where the backend supports it (NCCL >= 2.27; not gloo: recorded as unsupported);
  * created: the same groups made fresh with the spares in 2's and 3's places: one
    communicator per group from the generation's store (``ProcessGroupNCCL`` / ``Gloo``
    built directly, no world needed), and its first all-reduce (the connections).
Writes DIR/gpu_repair_counts.json: per W, per survivor (kept / shrunk / created, each with
sizes and seconds) and the busiest survivor's; prints a table. ``--device cpu`` rehearses
the script with gloo (no shrink). ``--dry-run`` prints what it would run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
DEAD = (2, 3)


def layout(world: int):
    """name -> member list of every group of TP2 x PP2 x DP world/4 (order tp-dp-pp)."""
    dp = world // 4
    rank = lambda t, d, p: t + 2 * d + 2 * dp * p  # noqa: E731
    out = {"world": list(range(world))}
    for p in range(2):
        for d in range(dp):
            out[f"tp{p}.{d}"] = [rank(t, d, p) for t in range(2)]
        for t in range(2):
            out[f"dp{p}.{t}"] = [rank(t, d, p) for d in range(dp)]
        out[f"tpdp{p}"] = [rank(t, d, p) for d in range(dp) for t in range(2)]
    for d in range(dp):
        for t in range(2):
            out[f"pp{d}.{t}"] = [rank(t, d, p) for p in range(2)]
    return out


def _backend_pg(backend, store, rank, size, device):
    import torch.distributed as dist

    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size)


def _touch(pg, device):
    import torch

    t = torch.ones(1, device=device)
    pg.allreduce([t]).wait()
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(args) -> None:
    """One process: rank ``args.rank`` (>= W: a spare taking DEAD[rank - W])."""
    import torch
    import torch.distributed as dist

    world, backend = args.world, ("nccl" if args.device == "cuda" else "gloo")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=__import__(
        "datetime").timedelta(seconds=120))
    groups, me = layout(world), args.rank
    spare = me >= world
    rank = DEAD[me - world] if spare else me
    rec = {"rank": rank, "spare": spare, "kept": [], "shrunk": [], "created": []}
    old = {}
    if not spare:
        for name, members in groups.items():
            if rank in members:
                pg = _backend_pg(backend, dist.PrefixStore(f"g0/{name}/", store),
                                 members.index(rank), len(members), device)
                _touch(pg, device)
                old[name] = pg
        store.add("built", 1)
        store.wait(["go"])
        if rank in DEAD:
            os._exit(9)  # node 1 dies; the survivors repair
        time.sleep(1.0)  # its sockets are gone
    broken = {n: m for n, m in groups.items() if rank in m and set(m) & set(DEAD)}
    if not spare:
        for name, members in groups.items():
            if name in old and name not in broken:
                t0 = time.perf_counter()
                _touch(old[name], device)
                rec["kept"].append([name, len(members), round(time.perf_counter() - t0, 4)])
        for name, members in broken.items():
            rec["shrunk"].append([name] + _shrink(old[name], members, rank))
    for name, members in broken.items():
        t0 = time.perf_counter()
        pg = _backend_pg(backend, dist.PrefixStore(f"g1/{name}/", store),
                         members.index(rank), len(members), device)
        _touch(pg, device)
        rec["created"].append([name, len(members), round(time.perf_counter() - t0, 4)])
    store.set(f"rec/{me}", json.dumps(rec))
    os._exit(0)


def _shrink(pg, members, rank):
    """``shrink_group`` of a broken communicator with abort, timed; or why not."""
    import torch.distributed as dist

    name_size = len(members) - len(set(members) & set(DEAD))
    if not hasattr(dist, "shrink_group"):
        return ["-", name_size, "unsupported: no torch.distributed.shrink_group"]
    try:  # shrink_group wants a registered group: register the standalone backend's
        t0 = time.perf_counter()
        supports = getattr(pg, "supports_shrinking", False)
        if not supports:
            return ["-", name_size, f"unsupported: {type(pg).__name__} cannot shrink"]
        flags = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)
        pg.shrink(sorted(members.index(d) for d in DEAD if d in members), flags, None)
        return ["ok", name_size, round(time.perf_counter() - t0, 4)]
    except Exception as exc:  # noqa: BLE001 - recorded: this is a probe
        return ["error", name_size, f"{type(exc).__name__}: {exc}"[:200]]


def one_world(world: int, device: str, timeout_s: float) -> dict:
    import torch.distributed as dist

    from megatron_deadpool.launch.gpus import SHARED_GPU_NCCL

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for me in range(world + len(DEAD)):
        env = dict(os.environ, **(SHARED_GPU_NCCL if device == "cuda" else {}),
                   NCCL_HOSTID=f"repair-w{world}-p{me}", CUDA_VISIBLE_DEVICES=os.environ.get(
                       "CUDA_VISIBLE_DEVICES", "0"), OMP_NUM_THREADS="1")
        argv = [sys.executable, __file__, "--worker", "--rank", str(me), "--world",
                str(world), "--port", str(store.port), "--device", device]
        if me >= world:  # the spares start once the job has built its groups
            store.wait(["built_all"], __import__("datetime").timedelta(seconds=timeout_s))
        procs.append(subprocess.Popen(argv, env=env))
        if me == world - 1:
            while store.add("built", 0) < world:
                time.sleep(0.05)
            store.set("built_all", "1")
            store.set("go", "1")
    deadline = time.time() + timeout_s
    for p in procs:
        p.wait(max(1.0, deadline - time.time()))
    recs = [json.loads(store.get(f"rec/{me}")) for me in range(world + len(DEAD))
            if me not in DEAD and store.check([f"rec/{me}"])]
    return summarize(world, recs)


def summarize(world: int, recs: list) -> dict:
    """Pure: per survivor, counts and sizes; the busiest survivor's."""
    surv = [r for r in recs if not r["spare"]]

    def n(r, k):
        return len(r[k])

    def members(r, k):
        return sum(x[1] for x in r[k])

    busiest = max(surv, key=lambda r: members(r, "created")) if surv else None
    return {"world_size": world, "survivors": len(surv), "spares": len(recs) - len(surv),
            "per_survivor_max": {k: max((n(r, k) for r in surv), default=0)
                                 for k in ("kept", "shrunk", "created")},
            "busiest": busiest, "records": recs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="8,16,32")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/gpu_repair")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    sizes = [int(w) for w in args.world_sizes.split(",")]
    if any(w % 4 or w < 8 for w in sizes):
        ap.error("--world-sizes: multiples of 4, at least 8")
    if args.dry_run:
        for w in sizes:
            print(f"W={w}: {w} ranks + 2 spares on one {args.device} device; groups "
                  f"{sorted(layout(w))}; node 1 (ranks 2, 3) exits; survivors keep, shrink "
                  f"(SHRINK_ABORT) and create; out {args.out}/gpu_repair_counts.json")
        return 0
    os.makedirs(args.out, exist_ok=True)
    result = {"device": args.device, "runs": []}
    for w in sizes:
        t0 = time.time()
        run = one_world(w, args.device, args.timeout_s)
        run["wall_s"] = round(time.time() - t0, 2)
        result["runs"].append(run)
        b = run["busiest"] or {}
        print(f"W={w:<3} per survivor (max): kept {run['per_survivor_max']['kept']}, shrunk "
              f"{run['per_survivor_max']['shrunk']}, created {run['per_survivor_max']['created']}"
              f"; busiest rank {b.get('rank')}: created {b.get('created')} shrunk "
              f"{b.get('shrunk')} ({run['wall_s']} s)", flush=True)
        with open(os.path.join(args.out, "gpu_repair_counts.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
