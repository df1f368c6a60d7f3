"""Progress on long work (``launch/progress.py``): one terminal line per iteration from the
workers' progress records, launcher events between them, every line in the log file. The
last test runs the demo end to end (slow)."""

import json
import re
import threading

import pytest

from conftest import deadpool
from megatron_deadpool.launch.progress import (Console, Progress, format_iteration,
                                               format_recovery, parse, shown)
from megatron_deadpool.base.worker_env import PROGRESS_PREFIX


def _line(prefix="[n3 r7] ", **rec):
    base = {"iteration": 12, "loss": 4.81234, "rank": 7, "step_s": 0.2124,
            "mirror_lag_s": 0.0351, "mirror_wait_s": 0.0, "generation": 0}
    return prefix + PROGRESS_PREFIX + json.dumps(dict(base, **rec))


def test_parse_finds_the_record_behind_the_agent_prefix():
    assert parse(_line())["iteration"] == 12
    assert parse("[n3 r7]  iteration 12/30 | lm loss: 4.8") is None
    assert parse("[n3 r7] " + PROGRESS_PREFIX + "{not json") is None
    assert parse("[n3 r7] " + PROGRESS_PREFIX + '{"loss": 1.0}') is None


def test_iteration_line_has_the_four_fields():
    assert format_iteration(parse(_line()), total=30) == \
        "iter 12/30 | loss 4.8123 | step 212 ms | mirror lag 35 ms"
    assert format_iteration(parse(_line(iteration=3)), total=150) == \
        "iter   3/150 | loss 4.8123 | step 212 ms | mirror lag 35 ms"
    assert format_iteration(parse(_line()), total=None).startswith("iter 12 | ")


def test_iteration_line_variants():
    off = format_iteration(parse(_line(generation=None, mirror_lag_s=None, loss=None)), 30)
    assert off == "iter 12/30 | loss - | step 212 ms | mirror off"
    waited = format_iteration(parse(_line(mirror_wait_s=0.0042)), 30)
    assert waited.endswith("mirror lag 35 ms (waited 4 ms)")
    after_restore = format_iteration(parse(_line(mirror_lag_s=None, generation=1)), 30, True)
    assert after_restore.endswith("| mirror lag - | redo")


def test_recovery_line():
    rec = parse(_line(recovery={"generation": 1, "restored_iter": 11, "failed_ranks": [2, 3],
                                "phases_s": {"abort": 0.01, "rendezvous": 1.5,
                                             "rebuild_groups": 0.2, "restore_state": 0.3,
                                             "first_step": 0.49}}))
    assert format_recovery(rec) == (
        "recovery (generation 1): ranks [2, 3] failed; restored iteration 11; 2.500 s on "
        "rank 7 (abort 0.010 | rendezvous 1.500 | rebuild_groups 0.200 | restore_state "
        "0.300 | first_step 0.490)")


def test_shown_lines():
    assert shown("[launch] injected kill on node 1 at iteration 12 (forward_backward)")
    assert shown("[agent n1] ignored 1 command(s) not signed with the job secret")
    assert shown("[n0 r0] error: --deadpool needs DEADPOOL_LID")
    assert not shown("[n0 r0] [deadpool lid0] failure seen at iteration 12: DistBackendError")
    assert not shown("[n3 r7]  [2024-01-01] iteration 12/30 | lm loss: 4.8E+00 |")
    assert not shown("Traceback (most recent call last):")


def test_progress_every_redo_and_recovery():
    p = Progress(total=20, every=5, label="run 1/1: ")
    out = []
    for it in range(1, 13):
        out += p.lines(_line(iteration=it))
    out += p.lines("[launch] generation 1: ranks [2, 3] -> spares [8, 9]")
    out += p.lines(_line(iteration=12, recovery={"generation": 1, "restored_iter": 11,
                                                 "failed_ranks": [2, 3], "phases_s": {}}))
    for it in range(13, 21):
        out += p.lines(_line(iteration=it))
    assert out[:2] == ["run 1/1: iter  5/20 | loss 4.8123 | step 212 ms | mirror lag 35 ms",
                       "run 1/1: iter 10/20 | loss 4.8123 | step 212 ms | mirror lag 35 ms"]
    assert out[2].startswith("[launch] generation 1")
    assert out[3].startswith("recovery (generation 1): ranks [2, 3] failed; restored "
                             "iteration 11; 0.000 s on rank 7")
    assert out[4].startswith("run 1/1: iter 12/20 |") and out[4].endswith("| redo")
    assert [x.split("|")[0] for x in out[5:]] == ["run 1/1: iter 15/20 ", "run 1/1: iter 20/20 "]
    assert p.iterations == 21


def test_console_routes_lines_and_logs_everything(tmp_path):
    class Term:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    log, term = tmp_path / "workers.log", Term()
    con = Console(str(log), total=30, stream=term)

    def agent(node):
        for i in range(200):
            con.write(f"[n{node} r{node}] noise {i}\n")

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    print("[launch] injected kill on node 1", file=con)  # print: text, then "\n"
    for t in threads:
        t.join()
    con.write(_line(iteration=1) + "\n" + _line(iteration=2)[:30])
    con.write(_line(iteration=2)[30:] + "\n")
    con.close()
    con.write("[n0 r0] after close\n")  # a late line is dropped, not an error
    assert term.text.splitlines() == [
        "[launch] injected kill on node 1",
        "iter  1/30 | loss 4.8123 | step 212 ms | mirror lag 35 ms",
        "iter  2/30 | loss 4.8123 | step 212 ms | mirror lag 35 ms"]
    logged = log.read_text().splitlines()
    assert len(logged) == 4 * 200 + 3 and "[n3 r3] noise 199" in logged

    verbose_term = Term()
    with Console(str(log), total=30, stream=verbose_term, verbose=True) as con:
        con.write("[n0 r0] noise\n" + _line() + "\n")
    assert verbose_term.text.splitlines() == ["[n0 r0] noise", _line()]


ITER_LINE = re.compile(r"^iter +(\d+)/(\d+) \| loss \d+\.\d{4} \| step \d+ ms \| "
                       r"mirror lag (\d+ ms|-)( \(waited \d+ ms\))?( \| redo)?$")


@pytest.mark.slow
def test_demo_prints_one_progress_line_per_iteration(tmp_path):
    """The demo, shortened: one line per iteration (the killed one again, marked redo),
    launcher events between, the log file named at start and end and holding the workers'
    output; still bitwise equal to the replay."""
    p = deadpool(["demo", "--train-iters", "8", "--kill-iter", "5", "--summary-json",
                  str(tmp_path / "d.json")], cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    iters = [ITER_LINE.match(x) for x in lines]
    seen = [int(m.group(1)) for m in iters if m]
    assert all(m.group(2) == "8" for m in iters if m)
    redone = [int(m.group(1)) for m in iters if m and m.group(5)]
    assert sorted(set(seen)) == list(range(1, 9)) and len(seen) == 8 + len(redone)
    assert set(redone) <= {4}  # killed in step 5: iteration 4 (or 3) restored
    assert sum(1 for m in iters if m and m.group(3) != "-") >= 6  # the mirror lag is measured
    assert any(x.startswith("[launch] injected kill on node 1") for x in lines)
    assert any(x.startswith("recovery (generation 1): ranks [2, 3] failed") for x in lines)
    assert any(re.match(r"^reference iter 8/8 \| .* \| mirror off$", x) for x in lines)
    assert not any("lm loss" in x or "[deadpool lid" in x for x in lines)  # no worker lines
    named = re.findall(r"full worker output: (\S+workers\.log)", p.stdout)
    assert len(named) == 2 and named[0] == named[1]
    with open(named[0]) as f:
        log = f.read()
    assert "lm loss" in log and "[n3 r7] " + PROGRESS_PREFIX in log
    assert "[n0 r0] final_state_sha256" in log  # other ranks' output too
    assert json.loads((tmp_path / "d.json").read_text())["bitwise_equal"] is True
