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
  reader moves the counter forward again at once (a record written in between, over an old
  one, is lost: the heartbeats still see what it said of a dead process).

Each skip is one entry, so the reader logs it once. The values themselves are checked by
``auth.open_`` (any bytes: an AuthError, never a crash).

**Owned slots** (``OwnedSlots``): a record with one writer that others poll (the decider's
generation pointer, its newest plan, a failure declaration, the shutdown flag) is lost if a
forger overwrites it after the readers' last look. The writer keeps what it wrote and puts
back any that changed (``heal``, on the decider's heartbeat cadence), so an overwrite
delays a reader by one cadence at most.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Dict, List, Optional, Tuple

HOLE_GRACE_S = 2.0
FORWARD_SCAN = 256   # indices after a run of missing ones timed with it
JUMP_SCAN = 4096     # a run of missing indices longer than this is ended from the counter's top
JUMP_RUN = 64        # ... at the first run this long found down from there

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
            key = self.key_of(i)
            if self.raw.check([key]):
                self._hole_since.pop(i, None)
                out.append((i, self.raw.get(key), ""))
                i += 1
                continue
            end = self._aged_stretch(i, n)
            if end < i:
                break  # most likely a writer between its add and its set: next time
            for j in [j for j in self._hole_since if j <= end]:
                del self._hole_since[j]
            out.append((end, None, f"indices {i}..{end} counted but never written"))
            i = end + 1
        return out

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
        """Put back every owned record that was changed; the keys put back."""
        keys = list(self._mine)
        healed = [key for key, now in zip(keys, self.raw.multi_get(keys))
                  if now != self._mine[key].encode()] if keys else []
        for key in healed:
            self.raw.set(key, self._mine[key])
        return healed


def peek(raw: Optional[bytes]) -> dict:
    """What a record that did not verify claims to be (for the log), or {}."""
    try:
        body = json.loads(raw.decode()).get("body")
        return body if isinstance(body, dict) else {}
    except (ValueError, AttributeError, RecursionError):  # a forged record: nothing claimed
        return {}


def append(raw, counter_key: str, key_of: Callable[[int], str],
           value_of: Callable[[int], str], tries: int = 64) -> int:
    """Write a counted queue's next record without overwriting one: the index comes from
    the counter, and the record lands only in an empty slot (``compare_set``), so a counter
    moved back makes the writer take the next index, never write over a genuine record.
    Returns the index."""
    for _ in range(tries):
        i = raw.add(counter_key, 1)
        value = value_of(i)
        if raw.compare_set(key_of(i), "", value) == value.encode():
            return i
    raise RuntimeError(f"{counter_key}: no free slot in {tries} tries (a forger moves the "
                       "counter back)")
