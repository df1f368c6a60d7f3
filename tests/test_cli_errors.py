"""Bad input: one clear error line, a non-zero exit, no traceback, nothing started."""

import pytest

from conftest import deadpool, layout_flags


@pytest.mark.parametrize("launch,flags,match", [
    (["--nodes", "3", "--procs-per-node", "1"], layout_flags(2, 2, 5),
     "world size 3 is not divisible by tensor-parallel x pipeline-parallel"),
    (["--nodes", "4", "--procs-per-node", "2"],
     [f if f != "8" else "6" for f in layout_flags(2, 2, 5)],
     "global-batch-size 6 is not divisible"),
    (["--nodes", "2", "--procs-per-node", "1"],
     [x for x in layout_flags(1, 1, 5) if x not in ("--hidden-size", "64")],
     "missing required flag.*--hidden-size"),
    (["--nodes", "2", "--procs-per-node", "1"], layout_flags(1, 1, 5) + ["--bogus"],
     "unrecognized arguments: --bogus"),
    (["--nodes", "2", "--procs-per-node", "1", "--inject", "kill:node=1@iter=3"],
     layout_flags(1, 1, 5), "--inject needs --deadpool"),
    (["--nodes", "2", "--procs-per-node", "1", "--inject", "kill:node=9@iter=3"],
     layout_flags(1, 1, 5) + ["--deadpool"], "node 9 does not exist"),
    (["--nodes", "2", "--procs-per-node", "1"],
     layout_flags(1, 1, 5) + ["--deadpool", "--deadpool-replicas", "2"], "at least 3 nodes"),
    (["--nodes", "2", "--procs-per-node", "1"],
     layout_flags(1, 1, 5) + ["--deadpool", "--deadpool-heartbeat-timeout", "0.1"],
     "twice"),
])
def test_bad_input_is_one_clear_error(tmp_path, launch, flags, match):
    p = deadpool(["launch", *launch, "--", *flags], cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1, p.stderr
    import re

    assert re.search(match, err[0]), err[0]


def test_launcher_usage_error(tmp_path):
    p = deadpool(["launch", "--procs-per-node", "2"], cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and "--nodes" in p.stderr and "Traceback" not in p.stderr
