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
- count far ahead (a **jump**): the skipped stretch is found without visiting every
  index: forward when it is short, else back from the counter's top, where the genuine
  writers that came after the jump wrote;
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
FORWARD_SCAN = 256   # a skipped stretch longer than this is found from the counter's top

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
        timed, so a stretch of forged ones ages at once."""
        now = self.clock()
        if n - i > FORWARD_SCAN:  # a jump: the genuine records since it sit at the top
            if now - self._hole_since.setdefault(i, now) < HOLE_GRACE_S:
                return i - 1
            j = n
            while j > i and self.raw.check([self.key_of(j)]):
                j -= 1
            return j
        end, j = i - 1, i
        while j <= n and not self.raw.check([self.key_of(j)]):
            if now - self._hole_since.setdefault(j, now) < HOLE_GRACE_S:
                # time every hole ahead now, so that holes age together, not one by one
                # behind each other (a flood of them would keep the reader behind for ever)
                for ahead in range(j + 1, min(n, j + FORWARD_SCAN) + 1):
                    if ahead not in self._hole_since and not self.raw.check([self.key_of(ahead)]):
                        self._hole_since[ahead] = now
                break
            end, j = j, j + 1
        return end


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
