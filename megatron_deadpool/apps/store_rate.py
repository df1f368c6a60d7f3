"""How many operations per second one TCPStore server serves (issue 57): the recovery's
rendezvous, its group creations and the mirror's rounds all go through the job's one store,
so at W ranks the server does the sum of every rank's operations, one after another. The
count law times a store operation as one rank sees it; at scale the server's rate bounds the
phase from below (apps/sim_scale.py).

``clients`` processes connect to a server hosted by this process (torch's default backend,
libuv) and each does ``n`` operations as fast as it can (set, get, add and check in turn, on
keys of its own, values of ``--value-bytes``, 64 by default); the rate is all operations over the time from the first
start to the last end. Prints one JSON object, written with ``--json``:

    python -m megatron_deadpool.apps.store_rate [--clients 4] [--n 5000] [--json F]

On a 2-core machine the clients and the server share the cores: the rate is a lower bound
for a datacenter host's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from datetime import timedelta


def _client(port: int, who: int, n: int, go, out, value_bytes: int = 64) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    value = b"x" * value_bytes
    go.wait()
    t0 = time.time()
    for i in range(n // 4):
        k = f"c{who}/{i % 64}"
        store.set(k, value)
        store.get(k)
        store.add(f"c{who}/n", 1)
        store.check([k])
    out.put((t0, time.time(), 4 * (n // 4)))


def rate(clients: int = 4, n: int = 5000, value_bytes: int = 64) -> dict:
    import torch
    import torch.distributed as dist

    if clients < 1 or n < 4 or value_bytes < 1:
        raise ValueError("--clients must be >= 1, --n >= 4 and --value-bytes >= 1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(server.port, c, n, go, out, value_bytes),
                         daemon=True)
             for c in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.2 * clients)  # every client connected before the clock starts
    go.set()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    ops = sum(s[2] for s in spans)
    wall = max(s[1] for s in spans) - min(s[0] for s in spans)
    # of the 4 operations a client does in turn, set and get carry the value
    return {"ops_per_s": round(ops / wall, 1), "op_s": ops and wall / ops, "ops": ops,
            "value_bytes": value_bytes,
            "value_bytes_per_s": round(ops / 2 * value_bytes / wall, 1),
            "clients": clients, "wall_s": round(wall, 4), "cpu_cores": os.cpu_count(),
            "backend": "libuv" if getattr(server, "libuvBackend", True) else "legacy",
            "torch": torch.__version__, "python": platform.python_version()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--n", type=int, default=5000, help="operations per client")
    ap.add_argument("--value-bytes", type=int, default=64, help="bytes a set writes and a "
                    "get reads (a large value: the server's bytes per second)")
    ap.add_argument("--json", default=None, metavar="FILE")
    a = ap.parse_args(argv)
    try:
        got = rate(a.clients, a.n, a.value_bytes)
    except ValueError as exc:
        ap.error(str(exc))
    print(json.dumps(got))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
