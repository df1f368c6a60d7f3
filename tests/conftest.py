"""Shared helpers: run the real `deadpool` CLI in a subprocess and read its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--global-batch-size", "8", "--lr", "1e-3", "--mock-data",
        "--use-distributed-optimizer", "--vocab-size", "128", "--device", "cpu"]


def layout_flags(tp: int, pp: int, iters: int, seed: int = 1234, world: int = 8):
    mbs = max(1, min(2, 8 // (world // (tp * pp))))  # global batch 8 must divide
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), *BASE, "--train-iters", str(iters),
            "--seed", str(seed)]


def deadpool(args, cwd, timeout=600, python=None):
    """Run `python -m megatron_deadpool.apps.cli ARGS` (this interpreter, or ``python``: the
    Python 3.12 environment of core_v0.19.0, tests/mlm.py); returns CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([python or sys.executable, "-m", "megatron_deadpool.apps.cli", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def state_diff(s, ref) -> dict:
    """{rank: the parts of its final state that differ from the reference run's}
    (``digest_parts`` in the ranks' result files): what a fingerprint mismatch is made of."""
    out = {}
    for r in range(s["layout"]["world_size"]):
        got, want = (json.loads((Path(x["results_dir"]) / f"rank{r}.json").read_text())
                     .get("digest_parts", {}) for x in (s, ref))
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        if diff:
            out[r] = diff
    return out


def job_output(p, tail: int = 5000) -> str:
    """A failed job's story for an assertion message: the launcher's and DeadPool's own lines
    first (what failed, fenced or recovered, and why: a CI log keeps only the message), then
    the last ``tail`` characters of the output and of its errors."""
    own = [x for x in p.stdout.splitlines() if x.startswith("[launch]") or "[deadpool" in x
           and "[deadpool progress]" not in x]
    return ("\n".join(own[-80:]) + "\n----- output tail -----\n" + p.stdout[-tail:]
            + "\n----- errors tail -----\n" + (p.stderr or "")[-3000:])


def assert_ok_and_bitwise(p, s, ref):
    """The job exited 0 and its final fingerprint and losses equal the failure-free run's."""
    assert p.returncode == 0, job_output(p)
    assert_bitwise(s, ref)


def assert_bitwise(s, ref):
    """The final fingerprint and the losses equal the reference run's; a mismatch names the
    ranks and parts that differ and the recoveries that ran."""
    same = (s["final_state_sha256"], s["losses"]) == (ref["final_state_sha256"], ref["losses"])
    assert same, json.dumps({"differs": state_diff(s, ref), "recoveries": s.get("recoveries"),
                             "losses": s["losses"], "reference_losses": ref["losses"]})


def launch(tmp_path, flags, nodes=4, ppn=2, spares=0, inject=(), extra_launch=(),
           timeout=600, name="run", python=None):
    summary = tmp_path / f"{name}.json"
    args = ["launch", "--nodes", str(nodes), "--procs-per-node", str(ppn),
            "--spare-nodes", str(spares), "--summary-json", str(summary),
            "--results-dir", str(tmp_path / name), *extra_launch]
    for spec in inject:
        args += ["--inject", spec]
    proc = deadpool(args + ["--", *flags], cwd=tmp_path, timeout=timeout, python=python)
    data = json.loads(summary.read_text()) if summary.exists() else None
    return proc, data


def kill_node_from_outside(tmp_path, flags, node=1, at_iter=5, on_line=None, timeout=600):
    """A real node loss, imitated with no fault driver and no fault point: launch 4 nodes x
    2 + 1 spare node, and once iteration ``at_iter`` is reported SIGKILL every process of
    ``node`` from outside the job. ``on_line(line)`` sees each output line first.
    Returns (CompletedProcess with the whole output, summary, the pids killed)."""
    import time

    from megatron_deadpool.apps.peer_inject import kill_all, node_pids
    from megatron_deadpool.launch import progress

    summary = tmp_path / "run.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "4",
         "--procs-per-node", "2", "--spare-nodes", "1", "--summary-json", str(summary),
         "--results-dir", str(tmp_path / "run"), "--", *flags, "--deadpool"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, killed = [], []
    deadline = time.monotonic() + timeout
    try:
        for line in p.stdout:
            out.append(line)
            if on_line is not None:
                on_line(line)
            rec = progress.parse(line)
            if not killed and rec is not None and rec["iteration"] >= at_iter:
                killed = kill_all(node_pids([p.pid], "DEADPOOL_NODE", str(node)))
            assert time.monotonic() < deadline, "".join(out[-50:])
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    # a failure's cause: the first errors the ranks printed, then the end of the output
    why = [ln for ln in out if "Error" in ln or "Traceback" in ln][:12] + out[-20:]
    assert len(killed) == 2, (killed, why)  # the node's two workers
    s = json.loads(summary.read_text()) if summary.exists() else None
    assert s is not None, why
    return subprocess.CompletedProcess(p.args, p.returncode, "".join(out), ""), s, killed


_REFERENCE = {}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Failure-free reference runs (mirror off), cached per (flags, nodes, ppn)."""

    def get(flags, nodes=4, ppn=2):
        key = (tuple(flags), nodes, ppn)
        if key not in _REFERENCE:
            d = tmp_path_factory.mktemp("reference")
            proc, data = launch(d, flags, nodes=nodes, ppn=ppn, name="reference")
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            _REFERENCE[key] = data
        return _REFERENCE[key]

    return get


class Counting:
    """The raw store, counting the operations made through it."""

    def __init__(self, raw):
        self.raw, self.n = raw, 0

    def __getattr__(self, name):
        op = getattr(self.raw, name)

        def counted(*a, **kw):
            self.n += 1
            return op(*a, **kw)
        return counted


def on_every_rank(world: int, fn, join_s: float = 60.0) -> list:
    """``fn(rank)`` for every rank at once, one thread each; by rank, what each returned or
    the exception it raised (the store-round tests compare both)."""
    import threading

    out = [None] * world

    def one(r):
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - compared by the tests
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return out


def in_processes(world: int, worker, *args, timeout: float = 240.0) -> dict:
    """``worker(rank, port, *args, queue)`` in ``world`` spawned processes, with a free port
    for their store; by rank, what each put on the queue. A worker puts its traceback as a
    string when it fails: any of those fails the caller here, all of them shown."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    errors = [v for v in got.values() if isinstance(v, str)]
    assert not errors, "\n".join(errors)
    return got
