"""The pure parts of the checkpoint cadence (adapters/cadence.py) and of abandoning an
asynchronous save (adapters/async_saves.py): when a save is redone after a restore, what
counts as a complete save, and which processes an abandoned writer leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron_deadpool.adapters import async_saves, cadence


def _args(**kw):
    base = dict(save="/ck", save_interval=4)
    base.update(kw)
    return SimpleNamespace(**base)


def test_a_save_is_due_where_the_failure_free_run_saved():
    meta = {"initial": False}
    assert cadence.due(_args(), 8, meta)
    assert not cadence.due(_args(), 9, meta)
    assert not cadence.due(_args(), 8, {"initial": True})  # the loaded iteration: no save
    assert not cadence.due(_args(), 8, None)
    assert not cadence.due(_args(save=None), 8, meta)
    assert not cadence.due(_args(save_interval=None), 8, meta)


def _ckpt(tmp_path, tracker=None, dirs=()):
    for it in dirs:
        (tmp_path / f"iter_{it:07d}").mkdir()
    if tracker is not None:
        (tmp_path / cadence.TRACKER).write_text(f"{tracker}\n")
    return str(tmp_path)


def test_complete_needs_the_tracker_and_the_directory(tmp_path):
    d = _ckpt(tmp_path, tracker=8, dirs=(4, 8, 12))
    assert cadence.tracked(d) == 8
    assert cadence.complete(d, 8) and cadence.complete(d, 4)
    assert not cadence.complete(d, 12)  # written, never finalized: the tracker names 8
    assert not cadence.complete(d, 16)
    (tmp_path / "none").mkdir()
    assert not cadence.complete(_ckpt(tmp_path / "none", dirs=(4,)), 4)  # no tracker


def test_release_tracker_is_not_an_iteration(tmp_path):
    d = _ckpt(tmp_path, dirs=(4,))
    (tmp_path / cadence.TRACKER).write_text("release")
    assert cadence.tracked(d) is None and not cadence.complete(d, 4)


def test_remove_partial_keeps_complete_saves_and_links(tmp_path):
    d = _ckpt(tmp_path, tracker=8, dirs=(8, 12))
    (tmp_path / "iter_0000012" / "__0_0.distcp").write_bytes(b"x")
    assert not cadence.remove_partial(d, 8) and (tmp_path / "iter_0000008").is_dir()
    assert cadence.remove_partial(d, 12) and not (tmp_path / "iter_0000012").exists()
    os.symlink(tmp_path / "iter_0000008", tmp_path / "iter_0000016")
    assert not cadence.remove_partial(d, 16) and (tmp_path / "iter_0000016").is_symlink()


def test_a_saves_redo_runs_once_and_only_at_its_iteration():
    s = cadence.Saves()
    s.arm(_args(), 8, {"initial": False})
    assert not s.run_if_due(None, _args(), 9, 0.0, {})  # another iteration: disarmed
    assert not s.run_if_due(None, _args(), 8, 0.0, {})
    s.arm(_args(), 7, {"initial": False})
    assert not s.run_if_due(None, _args(), 7, 0.0, {}) and s.redone == []


def test_process_tree_lists_every_descendant_once():
    parent_of = {10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20}
    assert async_saves.process_tree(10, parent_of) == [10, 11, 12, 13]
    assert async_saves.process_tree(21, parent_of) == [21]
    assert async_saves.process_tree(99, parent_of) == [99]


def test_kill_tree_ends_a_writer_and_the_writers_it_forked(tmp_path):
    """A writer killed alone leaves its forked children writing (they are re-parented):
    kill_tree ends them all."""
    marker = tmp_path / "child.pid"
    code = ("import os, time\n"
            "pid = os.fork()\n"
            f"if pid == 0:\n    open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(marker.read_text())
    killed = async_saves.kill_tree(p.pid)
    p.wait(timeout=10)
    assert p.pid in killed and child in killed
    assert not async_saves._alive(child) and not async_saves._alive(p.pid)


class _Queue:
    """Megatron's AsyncCallsQueue, as abandon() reads it (no writer process)."""

    def __init__(self, call_idx=-1, unfinalized=0):
        call = SimpleNamespace(async_caller=None)  # no writer process to kill
        self.call_idx, self.async_calls = call_idx, [call] * unfinalized
        self.closed = False

    def get_num_unfinalized_calls(self):
        return len(self.async_calls)

    def close(self, abort=False):
        self.closed = abort


@pytest.mark.parametrize("call_idx, unfinalized, fresh", [
    (-1, 0, False),  # never saved: already what a promoted spare has
    (0, 0, True),    # saved and finalized: its index must start again with the spare's
    (1, 1, True)])   # a save in flight: abandoned
def test_every_rank_that_saved_restarts_its_async_queue(monkeypatch, call_idx, unfinalized,
                                                        fresh):
    """A kill as a save began left some survivors with that save scheduled and others
    without: the finalize's all-reduce of the call index then failed on a promoted spare
    ("Unmatched async calls"). Every queue that ever scheduled a save is replaced."""
    import sys
    import types

    from megatron_deadpool.adapters import async_saves

    old = _Queue(call_idx, unfinalized)
    au = types.SimpleNamespace(_async_calls_queue=old)
    au.init_persistent_async_worker = lambda: setattr(au, "_async_calls_queue", _Queue())
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.async_utils", au)
    monkeypatch.setattr(sys.modules["megatron.training"], "async_utils", au, raising=False)
    monkeypatch.setattr(async_saves, "drain_results", lambda: 0)
    out = async_saves.abandon(types.SimpleNamespace(use_persistent_ckpt_worker=True))
    assert out["dropped"] == unfinalized
    assert (au._async_calls_queue is not old) == fresh and old.closed == fresh
    assert au._async_calls_queue.call_idx == -1
