"""A common change made as a newcomer makes it (docs/architecture.md "Common changes" (d)):
a no-op recovery phase ``verify_groups`` after ``rebuild_groups``, in a copy of the package.
The change is its ``Phase`` member (base/vocabulary.py) and one step class with one line in
each sequence (control/steps.py): two files. The copy is then run: its phase list and its
sequences agree, a promoted spare's model build is not timed as the new phase, the report
draws it, ``deadpool sim`` reads the committed measurements that lack it (with the same
results), and a real job with a node killed recovers through it (slow)."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, layout_flags
from megatron_deadpool.base.vocabulary import PHASE_ORDER, Phase
from test_common_changes import first_free

# the docs' example phase, under another name where this repository has it already (a
# newcomer who made (d) from the docs): the change is then made again, beside theirs
PHASE = first_free("verify_groups", {p.value for p in Phase})
# the repository's phases with the new one in its place, before restore_state
WITH_PHASE = [*PHASE_ORDER[:PHASE_ORDER.index("restore_state")], PHASE,
              *PHASE_ORDER[PHASE_ORDER.index("restore_state"):]]


def named(text: str) -> str:
    """The docs' example under ``PHASE``."""
    suffix = PHASE[len("verify_groups"):]
    return text.replace("VerifyGroups", "VerifyGroups" + suffix).replace(
        "VERIFY_GROUPS", PHASE.upper()).replace("verify_groups", PHASE)


STEP = named('''
class VerifyGroups(Step):
    """A no-op phase (tests/test_common_change_phase.py)."""

    phase = Phase.VERIFY_GROUPS

    def __call__(self, attempt: Attempt) -> Attempt:
        return attempt


''')
# (file, text, replacement, how many times): the whole change; the step goes last before
# the restore in SURVIVOR and SPARE
CHANGE = (
    ("base/vocabulary.py", '    RESTORE_STATE = "restore_state"\n',
     named('    VERIFY_GROUPS = "verify_groups"\n    RESTORE_STATE = "restore_state"\n'), 1),
    ("control/steps.py", "RESTORE: Seq[Type[Step]] = ", STEP + "RESTORE: Seq[Type[Step]] = ", 1),
    ("control/steps.py", ", *RESTORE)\n", named(", VerifyGroups, *RESTORE)\n"), 2),
)


def changed_files(left: Path, right: Path) -> list:
    """The files that differ between two package trees (relative paths)."""
    cmp = filecmp.dircmp(left, right, ignore=["__pycache__"])
    out = [f for f in cmp.diff_files + cmp.left_only + cmp.right_only]
    for sub, c in cmp.subdirs.items():
        out += [f"{sub}/{f}" for f in changed_files(left / sub, right / sub)]
    return sorted(out)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """A copy of the package with the new phase: the directory to put on PYTHONPATH."""
    root = tmp_path_factory.mktemp("with_phase")
    pkg = root / "megatron_deadpool"
    shutil.copytree(REPO / "megatron_deadpool", pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "docs" / "data", root / "docs" / "data")  # deadpool sim's inputs
    for rel, old, new, times in CHANGE:
        f = pkg / rel
        text = f.read_text()
        assert text.count(old) == times, (rel, old)
        f.write_text(text.replace(old, new))
    return root


def run_in(copy: Path, code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports the copy (and tests/ for the fakes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(copy), str(REPO / "tests")]))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=copy,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_the_change_is_two_files(copy):
    assert changed_files(REPO / "megatron_deadpool", copy / "megatron_deadpool") == [
        "base/vocabulary.py", "control/steps.py"]


# (d)'s part of the fast suite: every test that reads the phases
PHASE_TESTS = ("test_sequencer.py", "test_sim.py", "test_sim_counts.py", "test_report.py",
               "test_progress.py", "test_structure.py")


def test_the_tests_the_change_could_break_pass_on_the_copy(tmp_path):
    """(d) in a copy of the repository, the two files changed and nothing else: the copy's
    own tests that read the phases pass there (before issue 60, two of them listed today's
    phases by hand and failed)."""
    from test_common_changes import copy_repo, run_tests

    root = copy_repo(tmp_path)
    for rel, old, new, _ in CHANGE:
        f = root / "megatron_deadpool" / rel
        f.write_text(f.read_text().replace(old, new))
    assert changed_files(REPO / "megatron_deadpool", root / "megatron_deadpool") == [
        "base/vocabulary.py", "control/steps.py"]
    done = run_tests(root, PHASE_TESTS)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


@pytest.mark.parametrize("changed", [False, True], ids=["package", "copy"])
def test_the_phase_list_and_the_sequences_agree(copy, changed):
    """Each sequence's phases, in order, are ``RECOVERY_PHASES``' (detect is the decider's,
    first_step the runtime's); in the copy the new phase is in its place."""
    root = copy if changed else REPO
    out = run_in(root, """
        import json
        import megatron_deadpool
        from megatron_deadpool.base.vocabulary import PHASE_ORDER
        from megatron_deadpool.control import steps

        def phases(seq):
            out = []
            for s in seq:
                if not out or out[-1] != s.phase.value:
                    out.append(s.phase.value)
            return out

        print(json.dumps({"file": megatron_deadpool.__file__, "order": PHASE_ORDER,
                          "survivor": phases(steps.SURVIVOR), "spare": phases(steps.SPARE)}))
    """)
    got = json.loads(out.stdout)
    assert got["file"].startswith(str(root))
    order = got["order"]
    assert (order[order.index("restore_state") - 1] == PHASE) is changed
    assert ["detect", *got["survivor"], "first_step"] == list(order)
    assert ["detect", "abort", *got["spare"], "first_step"] == list(order)


def test_a_spares_model_build_is_not_timed_as_the_new_phase(copy, tmp_path):
    """The spare's walk pauses where the steps say (``Step.spare_waits``), not after a phase
    named by the runtime: the new phase runs inside ``initialize_model_parallel``, and the
    model build is timed in restore_state, as before (test_sequencer.py's fakes)."""
    out = run_in(copy, """
        import json, sys
        import pytest
        from test_sequencer import spare_walk, use_fake_restore

        with pytest.MonkeyPatch.context() as mp:
            use_fake_restore(mp)
            _, _, phases, report = spare_walk(__import__("pathlib").Path(sys.argv[1]), 0.2)
        print(json.dumps({"phases": phases, "report": report["phases_s"]}))
    """, str(tmp_path / "events.jsonl"))
    got = json.loads(out.stdout)
    phases = dict(got["phases"])
    assert [p for p, _ in got["phases"]] == WITH_PHASE[WITH_PHASE.index("rendezvous"):]
    # the phases' clock is virtual, moved only by the model build (test_sequencer.spare_walk)
    assert phases["restore_state"] == pytest.approx(0.2) and phases[PHASE] == 0.0
    assert set(got["report"]) == set(phases)


def test_the_report_draws_the_new_phase(copy, tmp_path):
    """A phase without a colour of its own gets the report's default, and the legend."""
    events = tmp_path / "e.jsonl"
    ev = [{"ts": 100.0 + it, "event": "step", "rank": 0, "iteration": it} for it in (1, 2)]
    ev += [{"ts": 102.5, "event": "phase", "phase": p, "duration_s": 0.1, "rank": 0}
           for p in ("rebuild_groups", PHASE)]
    events.write_text("".join(json.dumps(e) + "\n" for e in ev))
    out = run_in(copy, """
        import json, sys
        from megatron_deadpool.apps import report

        tl = report.timeline(report.read_events(sys.argv[1]))
        shown = report.legend_phases(tl)
        print(json.dumps({"shown": shown, "colors": [report.phase_color(p) for p in shown],
                          "png": report.draw(sys.argv[1], sys.argv[2])}))
    """, str(events), str(tmp_path / "t.png"))
    got = json.loads(out.stdout)
    assert got["shown"] == ["rebuild_groups", PHASE]
    assert got["colors"][1] == "#8c564b" and got["colors"][0] != got["colors"][1]
    assert Path(got["png"]).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("measured", ["bench_recovery.json", "bench_recovery_counts.json"])
def test_sim_reads_measurements_that_lack_the_phase(copy, tmp_path, measured):
    """``deadpool sim --measured`` on a committed file measured before the phase existed:
    the phase counts as 0 s, a warning says so, and every result is the package's own."""
    data = REPO / "docs" / "data" / measured

    def sim(root, out):
        env = dict(os.environ, PYTHONPATH=str(root))
        p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "sim",
                            "--measured", str(data), "--json", str(out)], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p, json.loads(out.read_text())

    p, got = sim(copy, tmp_path / "copy.json")
    _, want = sim(REPO, tmp_path / "repo.json")
    missing_before = want.pop("measured_phases_missing", [])  # a newcomer's phase, if any
    missing = got.pop("measured_phases_missing")
    assert missing == [ph for ph in WITH_PHASE if ph in missing_before or ph == PHASE]
    assert f"has no {', '.join(missing)} phase" in p.stdout + p.stderr
    assert got["scaling_law"].pop(PHASE)["form"]
    for scale in got["per_scale"].values():
        assert scale["hotswap_breakdown_s"].pop(PHASE) == 0.0
    assert got == want


@pytest.mark.slow
@pytest.mark.ci
def test_a_job_recovers_through_the_new_phase(copy, tmp_path):
    """The reference trainer in the copy, 2 nodes + 1 spare node, node 1 killed: the job
    recovers, and every rank times the new phase (the spare's: not its model build)."""
    events, summary = tmp_path / "ev.jsonl", tmp_path / "run.json"
    flags = layout_flags(1, 1, 6, world=2)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(copy))
    p = subprocess.run(
        [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "2",
         "--procs-per-node", "1", "--spare-nodes", "1", "--summary-json", str(summary),
         "--results-dir", str(tmp_path / "run"), "--inject", "kill:node=1@iter=3", "--",
         *flags, "--deadpool", "--deadpool-events", str(events)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["ok"] and s["completed_iters"] == 6
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [1] and PHASE in rec["phases_s"]
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    mine = [e for e in ev if e["event"] == "phase" and e["phase"] == PHASE]
    assert sorted(e["rank"] for e in mine) == [0, 1]  # the survivor and the spare
    spare = {e["phase"]: e["duration_s"] for e in ev
             if e["event"] == "phase" and e["rank"] == 1 and e.get("generation") == 1}
    # the exact check that the spare's model build is not timed as the new phase is the
    # in-process one above (a virtual clock); a real job's durations are not asserted
    assert PHASE in spare and spare["restore_state"] > 0, spare
