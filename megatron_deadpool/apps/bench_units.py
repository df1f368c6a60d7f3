"""``deadpool bench units``: what one unit of each counted kind of recovery work costs, timed
alone (issue 39: count, then time). The count law (``apps/sim_counts.py``) multiplies the
counts ``deadpool bench recovery --counts`` records by these costs, instead of fitting the
costs to a few world sizes where the counts rise together and cannot be told apart.

Two processes on an idle machine (one core each), a TCPStore hosted by the first, a gloo
world of 2; each kind timed ``rounds`` times, each round ``n`` operations, the median of the
rounds per unit:

    store_ops        set / get / add round trips on the store (through the same counting
                     wrapper ``--deadpool-count-work`` puts the generation's store behind)
    connections      a gloo group of 2 built with D devices opens D pairs: the slope of the
                     build time against D, its store operations taken out
    groups_created   ``new_group`` of 2 members: its time, its connection and store
                     operations taken out
    new_group_calls  ``new_group`` for a group this process is not a member of
    messages         half a gloo send/recv round trip of one element
    bytes            a 4 MiB gloo send/recv, per byte
    group_members    0: what a member costs is its connection and store operations,
                     counted on their own

    {"unit_s": {kind: seconds}, "samples": {...}, "rounds": R, "n": N, "cpu_cores": C}
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Callable, Dict, List, Tuple

from ..base import counts
from ..base.errors import DeadpoolError

DEVICES = 4            # the connections' slope: groups built with 1 and with DEVICES devices
BIG = 4 << 20          # bytes of one large message


def _timed(fn: Callable[[], None], n: int) -> Tuple[float, float]:
    """Per call of ``fn``: (seconds, store operations counted)."""
    ops, t = counts.snapshot()["store_ops"], time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n, (counts.snapshot()["store_ops"] - ops) / n


def _store_ops(store, n: int) -> float:
    """Per operation: a set, a get and an add, each a round trip."""
    per, ops = _timed(lambda: (store.set("u/k", b"x"), store.get("u/k"),
                               store.add("u/n", 1)), n)
    return per / max(1.0, ops)


def _gloo(store, rank: int, devices: int, tag: str):
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")] * devices
    opts._timeout = timedelta(seconds=60)
    return dist.ProcessGroupGloo(dist.PrefixStore(tag, store), rank, 2, opts)


def _build(store, rank: int, devices: int, n: int, tag: str):
    """Per build of a 2-member gloo group with ``devices`` devices: (seconds, store ops)."""
    keep, it = [], iter(range(n))
    return _timed(lambda: keep.append(_gloo(store, rank, devices, f"{tag}{next(it)}/")), n)


def _messages(rank: int, n: int, numel: int) -> float:
    """Half a round trip of a ``numel``-float32 tensor (rank 0 sends first)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(numel)

    def pingpong():
        if rank == 0:
            dist.send(t, 1), dist.recv(t, 1)
        else:
            dist.recv(t, 0), dist.send(t, 0)
    pingpong()
    return _timed(pingpong, n)[0] / 2


def _round(store, rank: int, n: int, i: int) -> Dict[str, float]:
    import torch.distributed as dist

    dist.barrier()
    store_s = _store_ops(store, n)
    dist.barrier()
    one, ops1 = _build(store, rank, 1, n, f"d1r{i}-")
    many, opsd = _build(store, rank, DEVICES, n, f"d{DEVICES}r{i}-")
    conn = max(0.0, (many - one - (opsd - ops1) * store_s) / (DEVICES - 1))
    dist.barrier()
    grp, grp_ops = _timed(lambda: dist.new_group([0, 1]), n)
    # each rank asks for a group of the other rank alone: both take torch's non-member path
    # (no store, no connection) once per call, so their group numbering stays in step
    other, _ = _timed(lambda: dist.new_group([1 - rank]), n)
    msg = _messages(rank, n, 1)
    big = _messages(rank, max(2, n // 10), BIG // 4)
    return {"store_ops": store_s, "connections": conn,
            "groups_created": max(0.0, grp - conn - grp_ops * store_s),
            "new_group_calls": other, "messages": msg,
            "bytes": max(0.0, big - msg) / BIG, "group_members": 0.0,
            "store_ops_per_new_group": grp_ops}


def worker(rank: int, port: int, rounds: int, n: int, out: str) -> None:
    import torch.distributed as dist

    from ..recovery import counting

    counting.count_store_ops()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    counted = counting.generation_store(store)
    dist.init_process_group("gloo", store=dist.PrefixStore("w/", counted), rank=rank,
                            world_size=2)
    samples = [_round(counted, rank, n, i) for i in range(rounds)]
    dist.barrier()
    with open(out, "w") as f:
        json.dump(samples, f)
    dist.destroy_process_group()


def units(rounds: int = 5, n: int = 40) -> dict:
    """Run the two processes; per kind the largest of the two ranks' medians."""
    import tempfile

    from ..launch.options import free_port

    if rounds < 1 or n < 2:
        raise DeadpoolError("--rounds must be >= 1 and --n >= 2")
    port = free_port()
    work = tempfile.mkdtemp(prefix="deadpool-bench-units-")
    outs = [os.path.join(work, f"rank{r}.json") for r in range(2)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", __name__, str(r), str(port), str(rounds),
                               str(n), outs[r]], env=env) for r in range(2)]
    if any(p.wait(timeout=600) for p in procs):
        raise DeadpoolError(f"bench units: a worker failed (rc {[p.returncode for p in procs]})")
    per_rank: List[List[dict]] = [json.load(open(o)) for o in outs]
    kinds = list(per_rank[0][0])
    med = {k: max(statistics.median(s[k] for s in rank) for rank in per_rank) for k in kinds}
    result = {"unit_s": {k: float(f"{v:.4g}") for k, v in med.items()
                         if k != "store_ops_per_new_group"},
              "store_ops_per_new_group": med["store_ops_per_new_group"],
              "samples": {f"rank{r}": rank for r, rank in enumerate(per_rank)},
              "rounds": rounds, "n": n, "devices": DEVICES, "cpu_cores": os.cpu_count()}
    for k, v in result["unit_s"].items():
        print(f"{k:<16} {v * 1e9:12.1f} ns", flush=True)
    return result


def add_arguments(p) -> None:
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=40, help="operations per round")


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
