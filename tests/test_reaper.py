"""The reaper drops what it is handed on its own thread, in order, and ``wait`` tells when
it is done (pure threading; the gloo groups' case is in test_rebind.py)."""

import threading

from megatron_deadpool.recovery.reaper import Reaper


class Tracked:
    def __init__(self, name, log, gate=None):
        self.name, self.log, self.gate = name, log, gate

    def __del__(self):
        if self.gate is not None:
            self.gate.wait(30)
        self.log.append((self.name, threading.current_thread().name))


def test_objects_die_on_the_reaper_thread_in_order():
    log = []
    r = Reaper()
    assert r.wait(0) and not r.pending()  # nothing handed over yet
    r.drop([Tracked("a", log), Tracked("b", log)])
    r.drop([Tracked("c", log)])
    assert r.wait(30)
    assert sorted(n for n, _ in log) == ["a", "b", "c"]
    assert {t for _, t in log} == {"deadpool-reaper"}
    assert [n for n, _ in log].index("c") == 2  # batches in the order handed over


def test_wait_is_false_while_a_destructor_blocks():
    log, gate = [], threading.Event()
    r = Reaper()
    r.drop([Tracked("slow", log, gate)])
    assert not r.wait(0.2) and r.pending()
    gate.set()
    assert r.wait(30) and not r.pending()
    assert log == [("slow", "deadpool-reaper")]


def test_an_empty_batch_starts_no_thread():
    r = Reaper()
    r.drop([])
    assert r._thread is None and r.wait(0)
