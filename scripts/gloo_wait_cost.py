"""What an abortable gloo wait costs (recovery/gloo_waits.py: every CPU gloo operation's wait
is handed to a waiter thread), per operation, on the calling process.

    python scripts/gloo_wait_cost.py [--ops 2000] [--rounds 2]

Two processes on one machine run ``--ops`` pairs of (all-reduce of 1024 floats, send/recv of
the same) on a gloo world, with the waits plain and wrapped, alternating ``--rounds`` times
(a fresh world each time). Prints one JSON line: per pair, the median process CPU time (user
+ system, both ranks' mean; the load-independent figure) and wall time of each variant, and
their differences: the wrapper's cost for two gloo operations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _rank(rank: int, port: int, wrapped: bool, ops: int, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if wrapped:
        from megatron_deadpool.recovery import gloo_waits

        gloo_waits.install()
    t = torch.ones(1024)
    for _ in range(50):  # warm up
        dist.all_reduce(t)
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
    q.put((rank, (time.process_time() - c0) / ops, (time.perf_counter() - w0) / ops))
    dist.destroy_process_group()


def _once(wrapped: bool, ops: int) -> tuple:
    import multiprocessing as mp

    from megatron_deadpool.launch.options import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, wrapped, ops, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return (statistics.mean(c for _, c, _ in got) * 1e6,
            statistics.mean(w for _, _, w in got) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    runs = {"plain": [], "wrapped": []}
    for _ in range(a.rounds):
        for name in ("plain", "wrapped"):
            runs[name].append(_once(name == "wrapped", a.ops))
    out = {"ops_per_run": a.ops, "rounds": a.rounds}
    for name, xs in runs.items():
        out[f"{name}_cpu_us_per_pair"] = round(statistics.median(c for c, _ in xs), 1)
        out[f"{name}_wall_us_per_pair"] = round(statistics.median(w for _, w in xs), 1)
    out["wrapper_cpu_us_per_pair"] = round(out["wrapped_cpu_us_per_pair"]
                                           - out["plain_cpu_us_per_pair"], 1)
    out["wrapper_wall_us_per_pair"] = round(out["wrapped_wall_us_per_pair"]
                                            - out["plain_wall_us_per_pair"], 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
