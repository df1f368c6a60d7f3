#!/usr/bin/env python3
"""The GPU check's first minute: can 3 processes, each its own NCCL host, share GPU 0 and
all-reduce? (The shared-GPU mode of ``deadpool launch --share-gpu``: launch/gpus.py's
SHARED_GPU_NCCL plus one NCCL_HOSTID per process, NCCL_DEBUG=INFO.)

    python scripts/nccl_smoke.py --json FILE [--log FILE] [--timeout-s 60] [--device cpu]

Writes FILE: ok, seconds, each rank's result, the NCCL version and the INFO lines NCCL
printed (the whole output goes to --log). Every process is killed at --timeout-s. Exit 0
only if every rank all-reduced the expected sum. ``--device cpu``: the same with gloo (a
rehearsal on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
WORLD = 3


def worker(rank: int, device: str) -> None:
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    res = {"rank": rank, "hostid": os.environ.get("NCCL_HOSTID")}
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=WORLD,
                                device_id=torch.device("cuda", 0))
        t = torch.full((1024,), float(rank + 1), device="cuda")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        t = torch.full((1024,), float(rank + 1))
    res["init_s"] = round(time.monotonic() - t0, 3)
    t1 = time.monotonic()
    dist.all_reduce(t)
    if device == "cuda":
        torch.cuda.synchronize()
    res["allreduce_s"] = round(time.monotonic() - t1, 4)
    res["sum"] = float(t[0].item())
    res["ok"] = res["sum"] == float(sum(range(1, WORLD + 1))) and bool((t == t[0]).all())
    dist.destroy_process_group()
    print("SMOKE_RESULT " + json.dumps(res), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--log")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.device)
        return 0
    from megatron_deadpool.launch.gpus import SHARED_GPU_NCCL

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NCCL_DEBUG="INFO", NCCL_HOSTID=f"deadpool-smoke-{r}", **SHARED_GPU_NCCL)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--json", a.json, "--device", a.device,
             "--worker", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs, timed_out = [], False
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(0.1, a.timeout_s - (time.monotonic() - t0)))[0])
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            outs.append(p.communicate()[0])
    text = "\n".join(f"[smoke rank {r}] {line}" for r, o in enumerate(outs)
                     for line in (o or "").splitlines())
    ranks = [json.loads(line.split("SMOKE_RESULT ", 1)[1]) for o in outs
             for line in (o or "").splitlines() if line.startswith("SMOKE_RESULT ")]
    version = None
    try:
        import torch

        if a.device == "cuda" and torch.cuda.is_available():
            version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 -- recorded as None
        pass
    result = {"device": a.device, "world": WORLD, "ok": len(ranks) == WORLD
              and all(r["ok"] for r in ranks), "timed_out": timed_out,
              "seconds": round(time.monotonic() - t0, 1), "timeout_s": a.timeout_s,
              "exit_codes": [p.returncode for p in procs], "ranks": ranks, "nccl": version,
              "nccl_info": [ln for ln in text.splitlines() if "NCCL INFO" in ln][-60:],
              "errors": [ln for ln in text.splitlines()
                         if "Error" in ln or "WARN" in ln or "Traceback" in ln][-30:]}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    if a.log:
        with open(a.log, "a") as f:
            f.write(f"\n===== NCCL smoke test ({a.device}, {WORLD} processes)\n{text}\n")
    print(f"[nccl smoke] ok {result['ok']} in {result['seconds']} s "
          f"(timed out {timed_out}; NCCL {version}; "
          f"{len(result['nccl_info'])} INFO lines kept)", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
