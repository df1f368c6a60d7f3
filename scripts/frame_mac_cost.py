"""CPU cost of the mirror's message tags (mirror/frames.py: HMAC-SHA256 over every byte a
snapshot message carries), per GB, on the thread that computes them.

    python scripts/frame_mac_cost.py [--mb 256] [--repeat 5]

Prints one JSON line: the median and range of CPU seconds per GB (thread CPU time, so
other load on the machine does not count) and the wall-clock GB/s of the same runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_deadpool.mirror import frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    buf = torch.randint(0, 256, (a.mb << 20,), dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    key = b"k" * 32
    frames.tag(key, 0, view[: 1 << 20])  # warm up
    cpu, wall = [], []
    for i in range(a.repeat):
        c0, w0 = time.thread_time(), time.perf_counter()
        frames.tag(key, i, view)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    gb = len(view) / 1e9
    per_gb = [c / gb for c in cpu]
    print(json.dumps({"bytes": len(view), "repeat": a.repeat,
                      "cpu_s_per_gb_median": round(statistics.median(per_gb), 4),
                      "cpu_s_per_gb_min": round(min(per_gb), 4),
                      "cpu_s_per_gb_max": round(max(per_gb), 4),
                      "wall_gb_per_s_median": round(gb / statistics.median(wall), 3)}))


if __name__ == "__main__":
    main()
