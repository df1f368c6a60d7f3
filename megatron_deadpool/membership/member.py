"""The worker side of membership: admission, heartbeats, the generation watcher, and waiting
for a plan (the rendezvous before a world forms is recovery/world.py ``meet``).

    Member.admit() ──► watcher thread: every 0.1 s
                          current generation > the live one ──► on_generation(g)
                          heartbeat every interval (iteration, state, committed)
                          job stopped ──► on_stop(reason)

The callbacks belong to the runtime (they abort this process's communicators, so its main
thread reaches the recovery boundary wherever it is blocked).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from typing import Callable, Iterator, Optional

from ..base.errors import DeadpoolError, stopped
from ..base.sections import SectionTracker
from . import auth
from . import store as st
from ..base.plan import Plan
from .store import EventKind

log = logging.getLogger(__name__)

WATCH_POLL_S = 0.1
PLAN_POLL_S = 0.02
# A standby spare does not poll the store: it sleeps until its watcher sees a newer
# generation or a stop, at most this long at a time. Polling every PLAN_POLL_S, two standby
# spares took 1-2 % of a 2-core machine's CPU from training (docs/peers.md).
STANDBY_NAP_S = 1.0
MOVED_SLICE_S = 0.5  # wait_moved: the longest nap between two looks (news wakes it)


class Member:
    def __init__(self, lid: int, node: int, host: str, port: int, secret: str,
                 heartbeat_interval_s: float, rendezvous_timeout_s: float,
                 counted: Callable = lambda store: store):
        """``counted``: wraps the main connection of the coordinator's calls (plan reads,
        barriers, reports) so that its operations are counted (--deadpool-count-work)."""
        self.lid, self.node = lid, node
        self.host, self.port, self.secret = host, port, secret
        self.heartbeat_interval_s = heartbeat_interval_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.store = st.connect(host, port, rendezvous_timeout_s)
        self.coord = st.Coordinator(counted(self.store), secret)
        self.stop_reason: Optional[str] = None
        self._bad_plans: set = set()  # generations whose plan slot did not verify (logged)
        self.sections = SectionTracker()  # the section heartbeats name (Deadpool.section)
        self._stop = threading.Event()
        self._news = threading.Event()  # the watcher saw a newer generation or a stop
        self._watcher: Optional[threading.Thread] = None
        self._watch_coord: Optional[st.Coordinator] = None
        self._node_stores: dict = {}  # node -> its record store's verified (host, port)
        self.seen_gen = -1  # the newest generation seen (the watcher's, every 0.1 s; reads)

    # -------------------------------------------------------------- admission and watch
    def admit(self, status: Callable[[], dict], on_generation: Callable[[int], None],
              on_stop: Callable[[str], None]) -> None:
        """Join the job (raises TokenError when refused), then start the watcher."""
        self.coord.request_admission(self.lid, self.rendezvous_timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="deadpool-watcher",
                                         args=(status, on_generation, on_stop), daemon=True)
        self._watcher.start()

    def _watch(self, status, on_generation, on_stop) -> None:
        client = st.Coordinator(st.connect(self.host, self.port, self.rendezvous_timeout_s),
                                self.secret)
        self._watch_coord = client  # the watcher's own connection (_here)
        seq, last_hb, seen = 0, 0.0, -1
        while not self._stop.is_set():
            try:
                gen = client.current_gen()
                if gen > seen:
                    seen = gen
                    self.seen_gen = max(self.seen_gen, gen)
                    self._news.set()
                on_generation(gen)
                now = time.monotonic()
                if now - last_hb >= self.heartbeat_interval_s:
                    seq += 1
                    sec = self.sections.status()
                    client.beat(self.lid, seq=seq, **status(), **sec)
                    self.sections.sent, last_hb = sec["section_n"], now
                if self.stop_reason is None:
                    reason = client.shutdown_reason()
                    if reason is not None:
                        self.stop_reason = reason
                        self._news.set()
                        on_stop(reason)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                if self._stop.is_set():
                    return
                time.sleep(0.5)
            time.sleep(WATCH_POLL_S)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """The heartbeats name section ``name`` while the body runs (``Deadpool.section``)."""
        self.sections.enter(name)
        try:
            yield
        finally:
            self.sections.leave()

    def step_done(self) -> None:
        """An iteration ended: progress, in the step section."""
        self.sections.step_done()

    def wait_beat_of_section(self) -> None:
        """Wait (at most three heartbeat intervals) until a heartbeat named the current
        section: a scheduled test fault that stops this process inside a section must find
        the decider knowing that section."""
        deadline = time.monotonic() + 3 * self.heartbeat_interval_s
        while self.sections.sent < self.sections.entered and time.monotonic() < deadline:
            time.sleep(WATCH_POLL_S / 4)

    def close(self) -> None:
        """Stop the watcher and wait for it. It is a daemon thread that spends its time in
        store calls (native code, GIL released): one still running when the interpreter
        exits is ended inside that call, in std::terminate (SIGABRT). So the wait is as long
        as one store call may block (the store's timeout), not a fixed few seconds that an
        overloaded machine can exceed."""
        self._stop.set()
        w = self._watcher
        if w is None or w is threading.current_thread():
            return
        w.join(timeout=self.rendezvous_timeout_s + 2 * WATCH_POLL_S + 1)
        if w.is_alive():
            log.warning("the membership watcher did not stop in %.0fs",
                        self.rendezvous_timeout_s)

    # -------------------------------------------------------------- plans
    def initial_plan(self) -> Plan:
        return self.coord.get_plan(0)

    def current_gen(self) -> int:
        """The job's current generation, read from its store (and kept as seen)."""
        g = self.coord.current_gen()
        self.seen_gen = max(self.seen_gen, g)
        return g

    def membership_moved(self, gen: int) -> bool:
        """A newer generation exists, or the decider declared a member of ``gen`` dead (its
        plan follows once replacements are ready)."""
        return self.current_gen() > gen or self.coord.is_failing(gen)

    def wait_moved(self, gen: int, timeout_s: float) -> bool:
        """After a communication error: True once a generation newer than ``gen`` exists,
        or, at the end, once the decider declared a member of ``gen`` dead (its plan follows
        when replacements are ready); False after ``timeout_s``. A member with a watcher
        takes the generation the watcher reads every WATCH_POLL_S anyway, woken by its
        news: no operation on the job's store until the end (issue 57: every survivor
        whose collective failed before the declaration polled the job's store, three
        operations every 0.02 s; then a wait on the next plan's key, whose 0.5 s timeouts
        torch logged, each with a reverse name lookup: records.polled). Without a watcher,
        the next plan's key is looked at (``polled``); a plan key that is there without a
        newer verified generation (a forger's) is looked at again every ``PLAN_POLL_S``."""
        from .records import polled

        deadline = time.monotonic() + timeout_s
        key = st.k("plan", gen + 1)
        while True:
            self._news.clear()  # before looking: the watcher's news after it ends the nap
            self.raise_if_stopped()
            if self.seen_gen > gen:  # the watcher saw it
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return self.membership_moved(gen)
            if self._watcher is not None:
                self._news.wait(min(MOVED_SLICE_S, left))  # woken by the watcher's news
            elif polled(self.store, [key], min(MOVED_SLICE_S, left)):
                if self.current_gen() > gen:
                    return True
                time.sleep(PLAN_POLL_S)

    def report_fatal(self, rank: int, exc: BaseException, attached: bool = True) -> None:
        """Tell the decider this rank stops on an error recovery must not handle: the job
        stops with it instead of spending a spare (best effort: the coordinator may be gone).
        Before it ``attached`` (the model build), a startup error (``startup.py``)."""
        from .startup import fields

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            if not attached:
                self.push_event(EventKind.STARTUP_ERROR, rank=rank, **fields(exc))
                return
            self.push_event(EventKind.FATAL, rank=rank, error=f"{type(exc).__name__}: {exc}"[:500],
                            traceback=text[-4000:])
        except Exception:  # noqa: BLE001 - the coordinator is gone: nothing to tell
            pass

    def raise_if_stopped(self) -> None:
        if self.stop_reason is not None:
            raise stopped(self.stop_reason)

    def wait_for_plan(self, min_gen: int, timeout_s: Optional[float],
                      exc: Optional[BaseException] = None) -> Plan:
        """The newest plan of generation >= ``min_gen`` that names this process. A plan that
        does not name it (a standby spare not chosen) is skipped. ``timeout_s`` None waits
        for ever (a standby spare); on timeout ``exc`` is raised (the failure that started the
        wait), else DeadpoolError. Raises JobStopped when the job stops meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._news.clear()  # before reading: news that comes after it ends the nap
            self.raise_if_stopped()
            # a survivor's watcher has seen the generation it was aborted for: no read of
            # the job's store for it (issue 57: one operation per rank per recovery)
            seen = self.seen_gen if self._watcher is not None else -1
            g = seen if seen >= min_gen else self.current_gen()
            plan = self._verified_plan(g) if g >= min_gen else None
            if plan is not None:
                if plan.rank(self.lid) is not None or timeout_s is not None:
                    return plan
                min_gen = g + 1
            if deadline is not None and time.monotonic() > deadline and \
                    self.coord.is_failing(min_gen - 1):
                # The decider declared the failure and is waiting for a replacement (a
                # starting or joining spare): it publishes the plan or stops the job.
                deadline = time.monotonic() + timeout_s
            if deadline is not None and time.monotonic() > deadline:
                if exc is not None:
                    raise exc
                raise DeadpoolError(f"no membership plan of generation >= {min_gen} arrived "
                                    f"in {timeout_s:.0f}s")
            if timeout_s is None and self._watcher is not None:
                self._news.wait(STANDBY_NAP_S)  # a standby spare: until the watcher's news
            time.sleep(PLAN_POLL_S)

    def moved_past(self, gen: int) -> None:
        """Raise GenerationMoved if a generation newer than ``gen`` exists, JobStopped if
        the job stopped (a wait before ``gen``'s world forms, recovery/world.py ``meet``,
        asks every slice it waits). What the watcher saw: no operation on the job's store
        (it reads the generation every WATCH_POLL_S anyway); without a watcher, the store."""
        self.raise_if_stopped()
        now = self.seen_gen if self._watcher is not None else self.current_gen()
        if now > gen:
            raise st.GenerationMoved(f"generation {now} replaced {gen}")

    # -------------------------------------------------------------- reports
    def node_store(self, node: int, fresh: bool = False):
        """(host, port) of node ``node``'s record store, or None (store.Coordinator's).
        A verified address is kept: a node's agent publishes it once, before its workers
        start, so a recovery reads no address from the job's store again (``fresh``: read
        it again, after a connection to the kept one failed)."""
        if fresh or node not in self._node_stores:
            where = self.coord.node_store(node)
            if where is None:
                return None
            self._node_stores[node] = where
        return self._node_stores[node]

    def heartbeats(self, lids) -> dict:
        """The verified last heartbeats of ``lids`` (store.Coordinator's)."""
        return self.coord.heartbeats(lids)

    def push_event(self, kind: EventKind, **fields) -> None:
        self.coord.push_event(kind, lid=self.lid, **fields)

    def report_recovery(self, gen: int, rank: int, report: dict) -> None:
        self.coord.put_rank_record("report", gen, rank, report)

    def _here(self) -> st.Coordinator:
        """The connection of the calling thread: a store client is not shared between the
        watcher and the main thread (one blocked call would stall the other's)."""
        on_watcher = threading.current_thread() is self._watcher
        return self._watch_coord if on_watcher and self._watch_coord else self.coord

    def peek_plan(self, gen: int) -> Optional[Plan]:
        """Generation ``gen``'s plan, without taking it (is it a drain's?)."""
        return self._verified_plan(gen, self._here())

    def _verified_plan(self, gen: int, coord: Optional[st.Coordinator] = None) -> Optional[Plan]:
        """``gen``'s plan, or None while its slot holds a record that does not verify (a
        forger overwrote it: logged once; the wait goes on until its deadline)."""
        try:
            return (coord or self.coord).get_plan(gen)
        except auth.AuthError as exc:
            if gen not in self._bad_plans:
                self._bad_plans.add(gen)
                log.warning("ignored generation %d's plan: %s", gen, exc)
            return None

    def post_boundary(self, gen: int, rank: int, iteration: int) -> None:
        """The iteration this rank stops at for planned generation ``gen``."""
        self._here().put_rank_record("boundary", gen, rank, {"iteration": int(iteration)})

    def boundaries(self, gen: int, world_size: int) -> Optional[list]:
        """Every rank's posted boundary for ``gen``, once all have posted, else None."""
        got = self.coord.rank_records("boundary", gen, world_size)
        return None if got is None else [int(b["iteration"]) for b in got]

    def reports_done(self, gen: int, world_size: int) -> bool:
        """Every rank of generation ``gen`` finished its first step after the restore."""
        return self.coord.rank_records("report", gen, world_size) is not None

    def claim_fault(self, index: int) -> bool:
        """True for the first process of the job to reach scheduled fault ``index``."""
        return self.store.add(st.k("inject", index), 1) == 1
