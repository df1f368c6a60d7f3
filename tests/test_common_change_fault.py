"""A common change made as a newcomer makes it (docs/architecture.md, "Common changes" (c)):
a new fault kind is one entry. In a copy of the package, ``sigstop_then_kill`` (SIGSTOP, then
after ``after=S`` seconds SIGKILL) is added by editing ``base/faults.py`` alone: a ``Kind``
member and a ``FaultKind`` entry. The parser, the validation, the worker's and the
launcher's deliveries and the CLI help take it from there; a real job recovers from it."""

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, layout_flags
from megatron_deadpool.base.faults import Kind
from test_common_changes import first_free

PKG = REPO / "megatron_deadpool"
# the docs' example kind, under another name where this repository has it already (a
# newcomer who made (c) from the docs): the change is then made again, beside theirs
NAME = first_free("sigstop_then_kill", {k.value for k in Kind})


def named(text: str) -> str:
    """The docs' example under ``NAME``."""
    return text.replace("sigstop_then_kill", NAME).replace("SIGSTOP_THEN_KILL", NAME.upper())


MEMBER = named('    SIGSTOP_THEN_KILL = "sigstop_then_kill"\n')
ENTRY = named('''    FaultKind(Kind.SIGSTOP_THEN_KILL, "the process hangs, then dies",
              ("SIGSTOP", Wait("after"), "SIGKILL"),
              params=(Param("after", "S", 0.0, default=1.0),), timed=True),
''')
HELP = named("sigstop_then_kill (SIGSTOP, wait after s, SIGKILL; after=S, S >= 0, default 1): "
             "the process hangs, then dies.")


def add_kind(dest: Path) -> Path:
    """Copy the package into ``dest`` and add the kind there, editing base/faults.py only;
    returns the folder to put on PYTHONPATH."""
    shutil.copytree(PKG, dest / "megatron_deadpool",
                    ignore=shutil.ignore_patterns("__pycache__"))
    edit_faults(dest / "megatron_deadpool" / "base" / "faults.py")
    return dest


def edit_faults(path: Path) -> None:
    """The edit of (c): a ``Kind`` member and a ``FaultKind`` entry in base/faults.py."""
    src = path.read_text()
    members_end = src.index("\n\n\n", src.index("class Kind(ValueEnum):")) + 1
    src = src[:members_end] + MEMBER + src[members_end:]
    kinds_end = src.index("\n)}\n", src.index("KINDS: Dict[Kind, FaultKind]")) + 1
    path.write_text(src[:kinds_end] + ENTRY + src[kinds_end:])


def _changed(a: Path, b: Path) -> list:
    """The files that differ between two package trees (relative paths)."""
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [str(Path(a.name) / n) for n in cmp.diff_files + cmp.left_only + cmp.right_only]
    for sub in cmp.common_dirs:
        out += [str(Path(a.name) / p) for p in _changed(a / sub, b / sub)]
    return out


def _env(root: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))


# Run inside the copy: the parser, the validation, the worker's delivery (the victim waits
# for its agent: a stopped process cannot go on) and the launcher's (SIGSTOP at once, SIGKILL
# ``after`` seconds later, from ``poll``).
CHECK = named(r'''
import json, types
from megatron_deadpool.base import faults as F
from megatron_deadpool.launch.fault_driver import FaultDriver
from megatron_deadpool.membership.procs import Proc

f = F.parse_fault("sigstop_then_kill:rank=1@iter=3,after=2")
out = {"parsed": [f.kind, f.rank, f.iteration, f.param("after"), f.describe(), f.by_agent,
                  f.signal_times()],
       "timed": F.parse_fault("sigstop_then_kill:node=0@t=4").describe(), "errors": []}
for bad in ("sigstop_then_kill:rank=1@iter=3,after=-1", "sigstop_then_kill:rank=1@iter=3,factor=2",
            "kill:rank=1@iter=3,after=2", "sigstop_then_kill:rank=1@iter=3,after=x"):
    try:
        F.parse_fault(bad)
    except F.ConfigError as exc:
        out["errors"].append(str(exc).split("; expected")[0])
F.NODE_SIGNAL_WAIT_S = 0.01
killed, reported = [], []
points = F.FaultPoints([f], rank=lambda: 1, node=1, claim=lambda i: True,
                       report=lambda *a: reported.append(a[1]), kill=killed.append)
points(3, "forward_backward")
out["worker"] = [killed, reported]
sent = []
decider = types.SimpleNamespace(max_iteration=lambda: 3, procs={
    0: Proc(0, 0, "active", 0), 1: Proc(1, 1, "active", 1)})
driver = FaultDriver([f], decider, lambda node, cmd: sent.append([node, cmd]),
                     log=lambda m: None, claim=lambda i: True)
driver.on_request({"index": 0, "t": 100.0})
out["at_once"] = list(sent)
driver.poll(101.9)
out["before_the_wait"] = list(sent)
driver.poll(102.0)
out["sent"] = sent
out["doc"] = F.kinds_doc()
print(json.dumps(out))
''')


def test_a_new_fault_kind_is_one_entry(tmp_path):
    """Parsing, validation, both deliveries and the help, in the copy with the new entry."""
    root = add_kind(tmp_path / "copy")
    assert _changed(PKG, root / "megatron_deadpool") == ["megatron_deadpool/base/faults.py"]
    p = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=_env(root),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["parsed"] == [NAME, 1, 3, 2.0, named("sigstop_then_kill:rank=1@iter=3,after=2"),
                             True,
                             [[0.0, "SIGSTOP"], [2.0, "SIGKILL"]]]
    assert out["timed"] == named("sigstop_then_kill:node=0@t=4,after=1")  # the default
    assert out["errors"] == [named(e) for e in (
        "a 'sigstop_then_kill' fault needs after=S with S >= 0, got -1.0",
        "a 'sigstop_then_kill' fault takes no factor=",
        "a 'kill' fault takes no after=",
        "bad --inject spec 'sigstop_then_kill:rank=1@iter=3,after=x': after must be a number, "
        "got 'x'")]
    assert out["worker"] == [[signal.SIGSTOP], [3]]  # reported, waited, no agent: the first
    stop = {"op": "signal", "signal": "SIGSTOP", "lids": [1]}
    assert out["at_once"] == out["before_the_wait"] == [[1, stop]]
    assert out["sent"] == [[1, stop], [1, {"op": "signal", "signal": "SIGKILL", "lids": [1]}]]
    assert " ".join(out["doc"].split()).endswith("* `" + HELP.replace(" ", "` ", 1))
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--help"],
                       cwd=tmp_path, env=_env(root), capture_output=True, text=True, timeout=60)
    assert HELP in " ".join(p.stdout.split())


def test_the_change_passes_the_tests_it_could_break_once_the_list_is_pasted(tmp_path):
    """(c) as docs/architecture.md gives it, in a copy of the repository: after the edit of
    base/faults.py the copy's tests/test_inject.py fails and prints the list of kinds; with
    that list pasted into the copy's docs/usage.md (the second file), the tests the change
    could break pass there."""
    from test_common_changes import copy_repo, run_tests

    root = copy_repo(tmp_path)
    edit_faults(root / "megatron_deadpool" / "base" / "faults.py")
    failed = run_tests(root, ["test_inject.py"])
    assert failed.returncode != 0 and "put faults.kinds_doc() there" in failed.stdout, \
        failed.stdout[-3000:]
    doc = subprocess.run([sys.executable, "-c", "from megatron_deadpool.base.faults import "
                          "kinds_doc; print(kinds_doc())"], cwd=root, env=_env(root),
                         capture_output=True, text=True, timeout=60).stdout.rstrip("\n")
    usage = root / "docs" / "usage.md"
    text = usage.read_text()
    start = text.index("  The kinds:\n") + len("  The kinds:\n")
    usage.write_text(text[:start] + doc + text[text.index("\n\n", start):])
    assert f"`{NAME}`" in doc
    passed = run_tests(root, ["test_inject.py", "test_structure.py"])
    assert passed.returncode == 0, passed.stdout[-5000:] + passed.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.ci
def test_a_new_fault_kind_runs_in_a_real_job(tmp_path):
    """The copy's ``deadpool launch`` with the new kind on rank 1 of a 2 x 1 job with a spare
    node: SIGSTOP, then 1 s later SIGKILL, one recovery, and the job finishes. Its detection
    took the wait (the kill's exit, not the 10 s heartbeat timeout a bare stop needs)."""
    root = add_kind(tmp_path / "copy")
    summary = tmp_path / "run.json"
    flags = layout_flags(1, 1, 8, world=2) + ["--deadpool", "--deadpool-heartbeat-interval",
                                              "0.25", "--deadpool-heartbeat-timeout", "10"]
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "launch",
                        "--nodes", "2", "--procs-per-node", "1", "--spare-nodes", "1",
                        "--summary-json", str(summary), "--results-dir", str(tmp_path / "run"),
                        "--inject", named("sigstop_then_kill:rank=1@iter=4,after=1"), "--", *flags],
                       cwd=tmp_path, env=_env(root), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["ok"] and s["completed_iters"] == 8
    assert [(f["kind"], f["ranks"], f["at_iter"]) for f in s["faults"]] == [
        (NAME, [1], 4)]
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [1]
    assert s["exit_codes"]["1"] == -9  # SIGKILL ended the stopped process
    # found by the kill's exit, not fenced by the 10 s heartbeat timeout a bare stop needs
    # (the decider's own lines say which, no duration asserted)
    out = p.stdout + p.stderr
    assert "failed: " in out and "fencing process" not in out, out[-3000:]
