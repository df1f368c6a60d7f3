#!/usr/bin/env python3
"""What a device call leaves under $OUT, made to come back whole (the device's rules: at most
8 files, 16 MiB each, 64 MiB together, at most 2 folders down, names of letters, digits,
'.', '_' and '-'). Python only: no tar, gzip or git is assumed on that machine.

    python scripts/gpu_outbox.py pack --work DIR --out DIR [--smoke FILE] [--facts FILE]
    python scripts/gpu_outbox.py check --root DIR

pack: merges the smoke test's and the machine's facts into WORK/cases/gpu_swap.json and
writes OUT/gpu_swap.json, OUT/gpu_swap.log.gz (WORK/gpu_swap.log) and
OUT/gpu_swap_cases.tar.gz (all of WORK/cases); then checks ROOT (OUT's parent when OUT is
inside $OUT) and prints the last 60 lines of the log. check: only the check; exit 1 if a
rule is broken, each broken rule on a line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import tarfile
from typing import List

MAX_FILES, MAX_DEPTH, MAX_FILE, MAX_TOTAL = 8, 2, 16 << 20, 64 << 20
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
TAIL = 60


def problems(root: str) -> List[str]:
    """Every way ``root`` would not come back whole (empty: it would)."""
    bad, files, total = [], 0, 0
    for d, dirs, names in os.walk(root):
        rel = os.path.relpath(d, root)
        depth = 0 if rel == "." else rel.count(os.sep) + 1
        for n in dirs + names:
            if not NAME.match(n):
                bad.append(f"name with other characters: {os.path.join(rel, n)}")
        for n in names:
            p = os.path.join(d, n)
            if os.path.islink(p) or not os.path.isfile(p):
                bad.append(f"not a plain file: {os.path.join(rel, n)}")
                continue
            files += 1
            size = os.path.getsize(p)
            total += size
            if depth > MAX_DEPTH:
                bad.append(f"more than {MAX_DEPTH} folders down: {os.path.join(rel, n)}")
            if size > MAX_FILE:
                bad.append(f"over 16 MiB: {os.path.join(rel, n)} ({size} bytes)")
    if files > MAX_FILES:
        bad.append(f"{files} files, more than {MAX_FILES}")
    if total > MAX_TOTAL:
        bad.append(f"{total} bytes in all, more than 64 MiB")
    return bad


def pack(work: str, out: str, smoke: str = None, facts: str = None) -> dict:
    os.makedirs(out, exist_ok=True)
    cases = os.path.join(work, "cases")
    os.makedirs(cases, exist_ok=True)
    path = os.path.join(cases, "gpu_swap.json")
    result = json.load(open(path)) if os.path.exists(path) else {
        "bench": "gpu_swap", "results": [], "bitwise": None, "deterministic": None,
        "error": "deadpool bench gpu wrote no JSON (see the log)"}
    for key, f in (("smoke", smoke), ("machine", facts)):
        if f and os.path.exists(f):
            try:
                result[key] = json.load(open(f))
            except ValueError as exc:
                result[key] = {"error": f"unreadable {os.path.basename(f)}: {exc}"}
        elif f:
            result[key] = {"error": f"not written: {os.path.basename(f)}"}
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out, "gpu_swap.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    log = os.path.join(work, "gpu_swap.log")
    text = open(log, "rb").read() if os.path.exists(log) else b""
    with gzip.open(os.path.join(out, "gpu_swap.log.gz"), "wb") as fh:
        fh.write(text)
    with tarfile.open(os.path.join(out, "gpu_swap_cases.tar.gz"), "w:gz") as tar:
        tar.add(cases, arcname="cases")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--root", help="the folder that comes back (default: $OUT if OUT is "
                   "set and holds --out, else --out)")
    p.add_argument("--smoke")
    p.add_argument("--facts")
    c = sub.add_parser("check")
    c.add_argument("--root", required=True)
    a = ap.parse_args()
    if a.cmd == "pack":
        pack(a.work, a.out, a.smoke, a.facts)
        env_out = os.environ.get("OUT")
        root = a.root or (env_out if env_out and os.path.abspath(a.out).startswith(
            os.path.abspath(env_out)) else a.out)
        log = os.path.join(a.work, "gpu_swap.log")
        lines = open(log, errors="replace").read().splitlines() if os.path.exists(log) else []
        print(f"----- the last {TAIL} lines of the log -----")
        print("\n".join(lines[-TAIL:]))
    else:
        root = a.root
    bad = problems(root)
    for b in bad:
        print(f"gpu_outbox: {root}: {b}", file=sys.stderr)
    if not bad:
        print(f"gpu_outbox: {root} comes back whole: "
              f"{sorted(os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
