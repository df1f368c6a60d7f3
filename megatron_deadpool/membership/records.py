"""Store records that a forger may have touched (issue 38: nothing a forged byte can
crash). Anyone who can reach the store can write any key without the secret; the MAC
(``auth.py``) keeps a forged record from being acted on, and this module keeps one from
stopping a reader or hiding a genuine record.

**Counted queues** (``CountedQueue``): the event queue ``dp/events`` and each node agent's
``dp/cmd/{node}``.

A writer takes index i from the queue's counter (``add``) and then writes key i, sealed for
i. Anyone who can reach the store can also move the counter without the secret:
- count without writing (a **hole**): index i never appears. Waiting on it (a store
  ``get``) blocked the reader up to the store's timeout and then raised, which ended the
  decider; now a hole younger than ``HOLE_GRACE_S`` (a genuine writer between its ``add``
  and its ``set``) holds the reader back, an older one is skipped as forged;
- count far ahead (a **jump**): the run of missing indices is timed at once and skipped
  once it has aged, as one entry. It is found forward, index by index, so a genuine record
  just after it is never skipped with it; a run longer than ``JUMP_SCAN`` is ended from the
  counter's top, where the genuine writers that came after the jump wrote;
- count back: later genuine writers would reuse indices the reader has passed, so the
  reader moves the counter forward again at once. A writer never writes over a record: it
  writes only into an empty slot (``compare_set``), and one whose slot is taken moves past
  the taken run (``append``, found in a few looks however long the run). A hole the reader
  skipped is **closed** (a marker written into it, ``CLOSED``), so a writer that lands on
  it after a count moved back, or that took longer than the grace between its ``add`` and
  its ``set``, finds it taken and moves past it, instead of writing behind the reader
  where its record was never read. A jump longer than ``JUMP_SCAN`` is closed only at its
  top (``JUMP_RUN`` indices): docs/threat-model.md says what is left open.

Each skip is one entry, so the reader logs it once. The values themselves are checked by
``auth.open_`` (any bytes: an AuthError, never a crash). No reader waits on a key: a record
deleted between a reader's look and its read is read as missing (``get_now``).

**Owned slots** (``OwnedSlots``): a record with one writer that others poll (the decider's
generation pointer, its newest plan, a failure declaration, the shutdown flag) is lost if a
forger overwrites it after the readers' last look. The writer keeps what it wrote and puts
back any that changed (``heal``, on the decider's heartbeat cadence), so an overwrite
delays a reader by one cadence at most. A record deleted is a changed one: it is put back
the same way, without a read that would wait for it.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HOLE_GRACE_S = 2.0
FORWARD_SCAN = 256   # indices after a run of missing ones timed with it
JUMP_SCAN = 4096     # a run of missing indices longer than this is ended from the counter's top
JUMP_RUN = 64        # ... at the first run this long found down from there
CLOSED = "\x00deadpool-closed"   # written into a skipped hole: no writer lands there later
_ABSENT = "\x00deadpool-absent"  # what get_now's compare_set answers for a missing key
REACH = 1 << 48      # how far past its slot a writer looks for a free one

Entry = Tuple[int, Optional[bytes], str]  # (index, record or None for a skip, why skipped)


class CountedQueue:
    """One reader's view of one counted queue."""

    def __init__(self, raw, counter_key: str, key_of: Callable[[int], str],
                 clock: Optional[Callable[[], float]] = None):
        self.raw, self.counter_key, self.key_of = raw, counter_key, key_of
        self.clock = clock or (lambda: time.monotonic())
        self._hole_since: dict = {}  # index -> when it was first found missing

    def read(self, start: int) -> List[Entry]:
        """The entries after index ``start``, in order. A written one is (i, record, "");
        a skip is (j, None, why), after which reading goes on at j + 1. The caller's
        cursor is the last entry's index."""
        n = self.raw.add(self.counter_key, 0)
        if n < start:  # put it back: the indices up to start were taken
            self.raw.add(self.counter_key, start - n)
            return [(start, None, f"the counter was moved back from {start} to {n}")]
        out: List[Entry] = []
        i = start + 1
        while i <= n:
            raw = get_now(self.raw, self.key_of(i))
            if raw is not None:
                self._hole_since.pop(i, None)
                out.append((i, raw, ""))
                i += 1
                continue
            end = self._aged_stretch(i, n)
            if end < i:
                break  # most likely a writer between its add and its set: next time
            end = self._close(i, end)
            if end < i:
                continue  # written since it was looked at: read next
            for j in [j for j in self._hole_since if j <= end]:
                del self._hole_since[j]
            out.append((end, None, f"indices {i}..{end} counted but never written"))
            i = end + 1
        return out

    def _close(self, i: int, end: int) -> int:
        """Close the skipped stretch ``i..end`` (all of it, or a long jump's top
        ``JUMP_RUN`` indices), so that no writer lands in it later; the skip's end: before
        the first slot that was written since it was looked at (read next, not skipped)."""
        low = i if end - i < JUMP_SCAN else end - JUMP_RUN + 1
        for j in range(low, end + 1):
            if self.raw.compare_set(self.key_of(j), "", CLOSED) != CLOSED.encode():
                return j - 1
        return end

    def _aged_stretch(self, i: int, n: int) -> int:
        """The last index of the stretch of unwritten indices from ``i`` on that have all
        been missing for ``HOLE_GRACE_S`` (``i - 1``: none has). Every missing index seen is
        timed at once, so a stretch of forged ones (a jump's) ages together, and so do the
        holes after it, not one after another."""
        now, limit = self.clock(), min(n, i + JUMP_SCAN - 1)
        end, j = i - 1, i
        while j <= limit and not self.raw.check([self.key_of(j)]):
            if now - self._hole_since.setdefault(j, now) < HOLE_GRACE_S:
                self._time_ahead(j + 1, n, now)
                return end
            end, j = j, j + 1
        if end == limit < n:  # a jump longer than the scan
            return self._jump_from_top(limit, n, now)
        return end

    def _time_ahead(self, j: int, n: int, now: float) -> None:
        """Time every missing index from ``j`` on, as far as a jump's scan reaches, and the
        top of a longer jump."""
        reach = min(n, j + JUMP_SCAN + FORWARD_SCAN)
        for ahead in range(j, reach + 1):
            if ahead not in self._hole_since and not self.raw.check([self.key_of(ahead)]):
                self._hole_since[ahead] = now
        if reach < n:  # a longer jump: its top, and the holes after it
            top = self._jump_top(reach, n)
            for ahead in range(top, n + 1):
                if ahead not in self._hole_since and not self.raw.check([self.key_of(ahead)]):
                    self._hole_since[ahead] = now

    def _jump_top(self, low: int, n: int) -> int:
        """The last index of the run of missing indices that reaches ``low`` from below,
        found from the counter's top, where the genuine writers after the jump wrote: the
        first run of JUMP_RUN missing indices down from there (a forger's single holes
        are not one), or the run that reaches ``low``."""
        j, run, top = n, 0, low
        while j > low and run < JUMP_RUN:
            if self.raw.check([self.key_of(j)]):
                run, top = 0, low
            else:
                run, top = run + 1, j if run == 0 else top
            j -= 1
        return top

    def _jump_from_top(self, limit: int, n: int, now: float) -> int:
        """The end of a jump longer than JUMP_SCAN (its first JUMP_SCAN indices missing
        and aged, up to ``limit``), once its top has aged too (a young one may be a genuine
        writer between its add and its set). A genuine record between two jumps longer
        than JUMP_RUN is skipped with them (docs/threat-model.md)."""
        top = self._jump_top(limit, n)
        if now - self._hole_since.setdefault(top, now) < HOLE_GRACE_S:
            return limit
        return top


class OwnedSlots:
    """The records one writer owns, put back whenever a forger changed them."""

    def __init__(self, raw):
        self.raw = raw
        self._mine: Dict[str, str] = {}

    def set(self, key: str, value: str, replaces: Optional[str] = None) -> None:
        """Write ``key`` and own it (``replaces``: a key of the same kind it supersedes)."""
        self._mine.pop(replaces, None)
        self._mine[key] = value
        self.raw.set(key, value)

    def heal(self) -> List[str]:
        """Put back every owned record that was changed or deleted; the keys put back.
        Never waits for a key: a deleted one was read with ``multi_get``, which held the
        decider for the store's timeout and raised."""
        keys = list(self._mine)
        whole = not keys or self.raw.check(keys)  # one look: is every owned key there?
        missing = set() if whole else {key for key in keys if not self.raw.check([key])}
        healed = []
        for key in keys:
            mine = self._mine[key]
            now = self.raw.compare_set(key, "", mine)  # a missing one is put back here
            if now != mine.encode():
                self.raw.set(key, mine)
            if key in missing or now != mine.encode():
                healed.append(key)
        return healed


def peek(raw: Optional[bytes]) -> dict:
    """What a record that did not verify claims to be (for the log), or {}."""
    try:
        body = json.loads(raw.decode()).get("body")
        return body if isinstance(body, dict) else {}
    except (ValueError, AttributeError, RecursionError):  # a forged record: nothing claimed
        return {}


POLL_FIRST_S = 0.001  # polled(): the first pause, doubling up to POLL_MOST_S
POLL_MOST_S = 0.02


def polled(store, keys: Sequence[str], seconds: float) -> bool:
    """True once every key of ``keys`` is in ``store``, False after ``seconds``: one
    ``check`` per look, the pauses between looks doubling from POLL_FIRST_S to POLL_MOST_S.
    For a wait that is expected to outlast its slice (a round that waits for its slowest
    member, looking at its generation every slice): a store ``wait`` that times out makes
    torch's TCPStore client log two warnings, and each formats the socket's addresses with
    a reverse name lookup. Where no name server answers, that lookup takes 5 s: at W = 32
    the rendezvous' 0.2 s slices left thousands of such lines and three ranks' rendezvous
    took 5.2 s (2026-11-29). A look costs one operation, on the node record stores."""
    deadline, keys = time.monotonic() + seconds, list(keys)
    pause = POLL_FIRST_S
    while True:
        if store.check(keys):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, POLL_MOST_S)


def waited(store, keys: Sequence[str], seconds: float) -> bool:
    """``store.wait(keys)``: False on its timeout (which torch logs: ``polled`` for a wait
    that often outlasts ``seconds``)."""
    try:
        store.wait(list(keys), timedelta(seconds=max(seconds, 1e-3)))
        return True
    except Exception as exc:  # noqa: BLE001 - torch's store error types vary by version
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            return False
        raise


def get_now(raw, key: str) -> Optional[bytes]:
    """The value of ``key``, or None if it is missing, without waiting for it (a store
    ``get`` waits for a missing key up to the store's timeout, then raises: a key deleted
    between a reader's ``check`` and its ``get`` held the reader and crashed it). A
    ``compare_set`` with an expected value that is never written answers a missing key
    with that value, and sets nothing."""
    absent = _ABSENT.encode()
    for _ in range(3):
        got = raw.compare_set(key, _ABSENT, _ABSENT)
        if got != absent:
            return got
        if not raw.check([key]):
            return None
        # written between the two calls (a writer's set after its add): read it again;
        # taking the placeholder for the record lost a genuine JOIN under load
    return got


def append(raw, counter_key: str, key_of: Callable[[int], str],
           value_of: Callable[[int], str], rounds: int = 16) -> int:
    """Write a counted queue's next record without overwriting one: the index comes from
    the counter, and the record lands only in an empty slot (``compare_set``). A writer
    whose slot is taken (a counter moved back over records, or over holes the reader
    closed) moves past the taken run (``_free_after``) and moves the counter there. Never
    raises for a forger's doing: returns the index, or -1 if every slot it reached in
    ``rounds`` tries was taken (the record is not written)."""
    i = raw.add(counter_key, 1)
    for _ in range(rounds):
        value = value_of(i)
        if raw.compare_set(key_of(i), "", value) == value.encode():
            return i
        free = _free_after(raw, key_of, i)
        top = raw.add(counter_key, 0)
        i = raw.add(counter_key, free - top if top < free else 1)
    return -1


def _free_after(raw, key_of: Callable[[int], str], i: int) -> int:
    """An empty slot past the taken slot ``i``: the first one after the run of taken slots
    from ``i``, found by doubling steps and then halving them, in about 2*log2(run) looks
    (a run of a million forged records: some 40)."""
    step = 1
    while step < REACH and raw.check([key_of(i + step)]):
        step *= 2
    low, high = i + step // 2, i + step  # low taken (or i itself), high empty
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if raw.check([key_of(mid)]) else (low, mid)
    return high
