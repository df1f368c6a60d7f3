"""A startup failure is not a node failure (membership/startup.py): a job whose workers fail
before they attach (a missing module, a bad Megatron-LM flag) exits non-zero with one
`deadpool: error:` line naming the exception and the first rank that raised it, and promotes
no spare. The launches use a real Megatron-LM tree through `deadpool launch --script`."""

from __future__ import annotations

import argparse
import re

import pytest

from conftest import launch
from megatron_deadpool.membership import startup
from megatron_deadpool.membership import store as st
from mlm import apply_patches, pristine_tree

SECRET = "k" * 32
MISSING = "a_missing_dependency_of_megatron"
DEADPOOL = ["--use-distributed-optimizer", "--deadpool"]


def test_describe_is_one_line_with_the_exception_type():
    assert startup.describe(ModuleNotFoundError(f"No module named '{MISSING}'")) == \
        f"ModuleNotFoundError: No module named '{MISSING}'"
    assert startup.describe(FileNotFoundError("no such file\n  more")) == \
        "FileNotFoundError: no such file"


def test_a_bad_flag_is_described_by_its_usage_error(monkeypatch):
    monkeypatch.setattr(argparse.ArgumentParser, "error", argparse.ArgumentParser.error)
    startup.keep_usage_errors()  # restored by monkeypatch
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--no-such-flag"])
    assert startup.describe(info.value) == \
        "SystemExit: pretrain_gpt.py: error: unrecognized arguments: --no-such-flag"


def test_clean_exits_and_stops_are_not_startup_errors():
    from megatron_deadpool.base.errors import JobStopped

    assert not startup.is_error(SystemExit(0)) and not startup.is_error(SystemExit(None))
    assert not startup.is_error(JobStopped("complete: all ranks finished"))
    assert startup.is_error(SystemExit(2)) and startup.is_error(ImportError("six"))


def test_report_pushes_a_signed_event_for_the_process():
    server = st.connect("127.0.0.1", 0, 30.0, is_master=True)
    env = {"DEADPOOL_LID": "3", "DEADPOOL_NODE": "1", "DEADPOOL_STORE_PORT": str(server.port),
           "DEADPOOL_TOKEN": SECRET, "RANK": "3"}
    try:
        import missing_dependency_for_this_test  # noqa: F401
    except ImportError as exc:
        startup.report(exc, env)
    (ev,) = st.Coordinator(server, SECRET).read_events(0)
    assert ev["kind"] == "startup_error" and ev["lid"] == 3 and ev["rank"] == 3
    assert ev["error"] == "ModuleNotFoundError: No module named " \
                          "'missing_dependency_for_this_test'"
    assert "import missing_dependency_for_this_test" in ev["traceback"]


def test_report_without_a_coordinator_does_nothing():
    startup.report(ImportError("six"), {"DEADPOOL_LID": "0", "DEADPOOL_NODE": "0",
                                        "DEADPOOL_STORE_PORT": "0"})  # no --deadpool
    startup.report(ImportError("six"), {})  # not started by deadpool launch


# ---------------------------------------------------------------- real launches
@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A patched Megatron-LM tree with one more entry point that needs a missing module,
    as pretrain_gpt.py needs `six` where it is not installed."""
    t = pristine_tree(tmp_path_factory.mktemp("mlm"))
    r = apply_patches(t)
    assert r.returncode == 0, r.stderr
    (t / "pretrain_missing_dependency.py").write_text(f"import {MISSING}  # noqa: F401\n")
    return t


def _launch(tmp_path, script, flags):
    """2 nodes x 1 process and a spare node, as a user would start a first try."""
    return launch(tmp_path, flags, nodes=2, ppn=1, spares=1,
                  extra_launch=["--device", "cpu", "--script", str(script)])


def _the_one_error_line(p) -> str:
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith("deadpool: error:")]
    assert len(lines) == 1, p.stdout[-4000:] + p.stderr[-2000:]
    return lines[0]


def _no_spare_promoted(p, s):
    assert s["recoveries"] == [] and "generation 1" not in p.stdout, p.stdout[-4000:]
    assert "no spare left" not in p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.ci
def test_a_missing_module_fails_fast_naming_it(tree, tmp_path):
    p, s = _launch(tmp_path, tree / "pretrain_missing_dependency.py", DEADPOOL)
    assert p.returncode != 0
    line = _the_one_error_line(p)
    assert re.fullmatch(rf"deadpool: error: ModuleNotFoundError: No module named '{MISSING}' "
                        r"\(first raised by rank [01]\)", line), line
    assert s["startup_error"] in line and s["error"].startswith("startup error: ")
    _no_spare_promoted(p, s)


@pytest.mark.slow
def test_a_bad_megatron_flag_fails_fast_naming_it(tree, tmp_path):
    p, s = _launch(tmp_path, tree / "pretrain_gpt.py", DEADPOOL + ["--no-such-megatron-flag"])
    assert p.returncode != 0
    line = _the_one_error_line(p)
    assert re.fullmatch(r"deadpool: error: SystemExit: .*unrecognized arguments: "
                        r"--no-such-megatron-flag \(first raised by rank [01]\)", line), line
    _no_spare_promoted(p, s)
