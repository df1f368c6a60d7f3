"""The mirror's collectives as rounds on the generation's store, so that no world-sized gloo
group is built for them (issue 39: per survivor, the mirror's connections and messages are
O(K), independent of W), each value signed with the job secret (issue 49: a client of the
store without the secret can forge no vote, size or count), and no rank reading or
verifying O(W) records (issue 57: before, rank 0 read, verified and answered every
member's record in each round: 101 / 172 / 316 store operations in a restore at W = 8 / 16
/ 32).

The members form a tree of fan-out ``FANOUT`` (rank x's parent is (x - 1) // FANOUT, its
children FANOUT x + 1 ... FANOUT x + FANOUT; rank 0 is the root). A round r, for rank x::

    up:    x waits for {r}/u/{c} of each child c (looks, ``records.polled``, then get_now
           of each: a read never waits on a key deleted after the look), verifies each,
           merges them with its own posts and adds, and writes its subtree's signed record
           {r}/u/{x}: the posts, the adds summed, the topics and counters its subtree reads,
           and the ranks named forged below it
    root:  rank 0 has merged the whole world's: the posts (sorted by poster), the totals
    down:  x waits for {r}/d/{x}, written by its parent and signed for x, verifies it, and
           writes each child's {r}/d/{c}: the part of it that the child's subtree reads;
           then deletes its own {r}/u/{x} and {r}/d/{x} (both read by then)

Each rank verifies at most FANOUT + 1 records and does at most MAX_OPS_PER_ROUND (14) store
operations per round (plus the looks of its waits, one ``check`` each, and one
``compare_set`` per SLICE_S it waits), at
any W; a round takes 2 log_FANOUT W store hops in a row. Rank 0 still merges O(W) bytes of
posts (the store server did O(W) per round already). Rounds are numbered per generation,
and every member runs the same rounds in the same order (the mirror's calls are
collective, as they were on a gloo group). The keys of a round are per round, so that a
wait on them lasts until they are written, and deleted once read, so that a
generation's keys do not grow with its steps.

    all_ok(flag)            an AND: the sum of the members' "false" adds
    gather_from(v, ranks)   the values of ``ranks`` only (a holder's owners' slot sizes)
    all_gather_json(obj)    every member's value (O(W) bytes to each): kept for the
                            interface, not on the recovery's path

Forgery (round_records.py has the records). Only verified records are merged. An up record
that fails its MAC, is signed for another slot or is an older round's (put there by a
forger) is forged once it has stayed so for ``GRACE_S`` (its writer puts its own back every
``SLICE_S`` while it waits, and a genuine writer may still overwrite a forger's early
write); the parent then names it, the name travels up to the root and down to every member
with the result, and the round fails with ForgedRecordError naming the ranks, on every
member. A down record that stays forged for ``GRACE_S`` fails the round for the rank that
reads it and, named in the records it writes, for its subtree. ``all_ok`` takes that as a
"no" vote (the iteration does not commit, the job goes on); every other round stops the
recovery with it, never with NoCommittedStateError. A record deleted by a forger: an up
record is put back by its writer within ``SLICE_S``; a down record (as the old ``done``
key) leaves its reader waiting until ``timeout_s``: denial of service, as any deletion.

A member that dies leaves the others waiting until ``timeout_s`` (a ``TransportTimeout``)
or until the abort shuts the generation's store connection down.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..base import counts
from ..base.errors import ForgedRecordError, TransportTimeout
from ..membership.records import get_now, polled
from . import round_records as rr

log = logging.getLogger(__name__)

PREFIX = "mirror/rounds/"
ROOT = 0
FANOUT = 4       # children per member: each rank verifies at most FANOUT + 1 records
# a rank's store operations in one round, at most, as --deadpool-count-work counts them (a
# key of a multi_set once): one look for its children, a get_now of each child's record,
# its own record, one look and one get_now for its result, its children's results, two
# deletes (a wait's further looks add more: records.polled)
MAX_OPS_PER_ROUND = 2 * FANOUT + 6
GRACE_S = 2.0    # a forged record that stays forged this long fails the round
SLICE_S = 1.0    # a waiting rank looks at its own up record this often (put back if changed)
POLL_S = 0.005   # while a record is stale or forged (the first wait; doubling to 50 ms)


def parent_of(rank: int) -> Optional[int]:
    return None if rank == ROOT else (rank - 1) // FANOUT


def children_of(rank: int, world_size: int) -> List[int]:
    return [c for c in range(FANOUT * rank + 1, FANOUT * rank + FANOUT + 1) if c < world_size]


class StoreRounds:
    kind = "store"

    def __init__(self, store, rank: int, world_size: int, timeout_s: float = 600.0,
                 secret: Optional[str] = None, gen: int = 0,
                 at: Optional[Callable[[int], Any]] = None, prefix: str = PREFIX,
                 check: Callable[[], None] = lambda: None, slice_s: Optional[float] = None):
        """``store``: this generation's (a key written in one generation is never read in
        another: world.py prefixes the store per generation); ``secret``, ``gen``: the job's
        and this generation's, bound into every record (None: an empty key, for tests that
        run the rounds alone; the runtime always passes the job's). ``at(x)``: the store
        that keeps the records rank x reads (its node's record store, world.py
        ``record_stores``); a child's up and down records are kept where its parent reads,
        so a rank uses its own node's store and its parent's, and each server carries the
        records of its node's ranks' children. None: all on ``store``. ``prefix``: the
        keys' (one per user of the rounds: the mirror's, the keep votes'). ``check()``:
        called every ``slice_s`` (None: SLICE_S) a wait lasts; it may raise to end the
        round (a barrier before the generation's world exists, which no abort reaches:
        GenerationMoved)."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.check, self.slice_s = check, slice_s
        self.secret, self.gen = secret or "", gen
        self.parent, self.children = parent_of(rank), children_of(rank, world_size)
        where, self._on_nodes = at or (lambda x: store), at is not None
        # this rank's own records (read by its parent); its children's (read by it)
        self._mine_at = where(self.parent) if self.parent is not None else store
        self._kids_at = where(rank) if self.children else store
        self._round = 0
        self._mine = ""  # this rank's up record of the current round (put back if changed)

    def round(self, posts: Mapping[str, Any] = {}, adds: Mapping[str, int] = {},
              read_posts: Sequence[str] = (), read_counts: Sequence[str] = (),
              timeout_s: Optional[float] = None, what: str = "round", shared: bool = False
              ) -> Tuple[Dict[str, List[Tuple[int, Any]]], Dict[str, int]]:
        """Post ``posts`` (topic -> JSON value), add ``adds`` (counter -> amount), wait for
        every member, then return the posts of ``read_posts`` (topic -> [(poster, value)],
        by poster) and the totals of ``read_counts``. ``shared``: every member reads the
        same (the up records do not carry what is read). Raises ForgedRecordError (module
        docstring)."""
        self._round += 1
        r = self._round
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        sub = {"posts": {t: [[self.rank, v]] for t, v in posts.items()},
               "adds": {k: int(v) for k, v in adds.items()},
               "reads": [] if shared else sorted(set(read_posts)),
               "counts": [] if shared else sorted(set(read_counts)), "forged": {}}
        wants = {}  # child -> the topics and counters its subtree reads
        for c, (body, why) in self._ups(r, what, deadline, limit).items():
            if body is None:
                sub["forged"][str(c)] = why
                wants[c] = ((), ())
                continue
            _merge(sub, body)
            wants[c] = (body["reads"], body["counts"])
        if shared:
            wants = {c: (read_posts, read_counts) for c in wants}
        if self.parent is None:
            down = {"posts": {t: sorted(ps, key=lambda p: p[0])
                              for t, ps in sub["posts"].items()},
                    "counts": sub["adds"], "forged": sub["forged"]}
        else:
            self._mine = rr.seal(self.secret, "up", self.gen, r, what, **{"from": self.rank},
                                 **sub)
            self._mine_at.set(self._key(r, "u", self.rank), self._mine)
            counts.add("messages")
            counts.add("bytes", len(self._mine))
            down = self._down(r, what, deadline, limit)
        if self.children:
            sealed = [rr.seal(self.secret, "down", self.gen, r, what, to=c,
                              **_part(down, *wants[c])) for c in self.children]
            self._kids_at.multi_set([self._key(r, "d", c) for c in self.children], sealed)
            counts.add("messages", len(sealed))
            counts.add("bytes", sum(len(s) for s in sealed))
        if self.parent is not None:
            self._forget([self._key(r, "u", self.rank), self._key(r, "d", self.rank)])
        if down["forged"]:
            raise ForgedRecordError(rr.forged_message(what, r, down["forged"]))
        return ({t: [tuple(p) for p in down["posts"].get(t, [])] for t in read_posts},
                {c: int(down["counts"].get(c, 0)) for c in read_counts})

    # ------------------------------------------------------------ the collectives
    def all_ok(self, ok: bool, timeout_s: Optional[float] = None) -> bool:
        """The world's AND. A forged vote is no "yes": the round's iteration does not
        commit, and the job goes on (logged)."""
        try:
            _, n = self.round(adds={"false": 0 if ok else 1}, read_counts=["false"],
                              timeout_s=timeout_s, what="commit", shared=True)
        except ForgedRecordError as exc:
            log.warning("%s: the vote is taken as a no", exc)
            return False
        return n["false"] == 0

    def gather_from(self, value, ranks: Sequence[int], timeout_s: Optional[float] = None
                    ) -> Dict[int, Any]:
        got, _ = self.round(posts={f"r{self.rank}": value},
                            read_posts=[f"r{x}" for x in ranks], timeout_s=timeout_s,
                            what="gather")
        out = {}
        for x in ranks:
            posted = got[f"r{x}"]
            if len(posted) != 1 or posted[0][0] != x:
                raise TransportTimeout(f"mirror gather: rank {x} posted {len(posted)} values")
            out[x] = posted[0][1]
        return out

    def all_gather_json(self, obj, timeout_s: Optional[float] = None) -> List:
        ranks = range(self.world_size)
        got, _ = self.round(posts={f"r{self.rank}": obj}, read_posts=[f"r{x}" for x in ranks],
                            timeout_s=timeout_s, what="gather", shared=True)
        out = {x: v for t in got for x, v in got[t] if t == f"r{x}"}
        missing = [x for x in ranks if x not in out]
        if missing:
            raise TransportTimeout(f"mirror gather: ranks {missing} posted no value")
        return [out[x] for x in ranks]

    def all_gather_int(self, value: int, timeout_s: Optional[float] = None) -> List[int]:
        return [int(v) for v in self.all_gather_json(int(value), timeout_s)]

    def release(self) -> None:
        """The generation is over: nothing to close (its keys went with its store prefix),
        nothing for the reaper."""
        return None

    # ------------------------------------------------------------ the store
    def _key(self, r: int, way: str, x: int) -> str:
        return f"{self.prefix}{r}/{way}/{x}"

    def _timeout(self, what: str, limit: float, why: str = "") -> TransportTimeout:
        return TransportTimeout(f"mirror {what}: not every member arrived in {limit:g}s{why}")

    def _ups(self, r: int, what: str, deadline: float, limit: float
             ) -> Dict[int, Tuple[Optional[dict], str]]:
        """Each child's verified up record of round ``r``; (None, why) for one still forged
        (or an older round's) GRACE_S after it was first read so."""
        if not self.children:
            return {}
        keys = [self._key(r, "u", c) for c in self.children]
        while not polled(self._kids_at, keys, min(self._slice(), deadline - time.monotonic())):
            self.check()
            if time.monotonic() >= deadline:
                raise self._timeout(what, limit, f" (no record of this round from ranks "
                                    f"{self.children} or below them)")
        raws = [get_now(self._kids_at, key) for key in keys]  # never a wait on a deleted key
        counts.add("messages", len(keys))
        got = {c: rr.check(self.secret, raw, "up", self.gen, r, what, **{"from": c})
               for c, raw in zip(self.children, raws)}
        since, pause = time.monotonic(), POLL_S
        while True:
            bad = [c for c, (body, _) in got.items() if body is None]
            now = time.monotonic()
            if not bad or now - since >= min(GRACE_S, max(deadline - now, 0)):
                return {c: (body, why if why != rr.STALE else "missing, or an older round's "
                            "record") for c, (body, why) in got.items()}
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            for c in bad:
                raw = self._read(self._kids_at, self._key(r, "u", c), pause)
                got[c] = rr.check(self.secret, raw, "up", self.gen, r, what, **{"from": c})

    def _down(self, r: int, what: str, deadline: float, limit: float) -> dict:
        """This rank's down record of round ``r``, once its parent has written it:
        verified; when it stays forged (or an older round's) for GRACE_S, a result that
        names it (so that this rank's subtree fails the round too)."""
        key = self._key(r, "d", self.rank)
        while not polled(self._mine_at, [key], min(self._slice(), deadline - time.monotonic())):
            self.check()
            if time.monotonic() >= deadline:
                raise self._timeout(what, limit)
            self._heal(r)
        since, pause = time.monotonic(), POLL_S
        raw = get_now(self._mine_at, key)
        while True:
            counts.add("messages")
            body, why = rr.check(self.secret, raw, "down", self.gen, r, what, to=self.rank)
            if body is not None:
                return body
            if time.monotonic() - since >= min(GRACE_S, max(deadline - time.monotonic(), 0)):
                why = why if why != rr.STALE else "missing, or an older round's"
                return {"posts": {}, "counts": {},
                        "forged": {str(self.rank): f"its result: {why}"}}
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            self._heal(r)
            raw = self._read(self._mine_at, key, pause)

    def _slice(self) -> float:
        return SLICE_S if self.slice_s is None else self.slice_s

    def _read(self, store, key: str, seconds: float) -> Optional[bytes]:
        """The key's value, or None if it is not there within ``seconds`` (a wait, then
        get_now: a plain get of a key a forger deleted after the wait would hold the reader
        until the store's timeout)."""
        return get_now(store, key) if polled(store, [key], seconds) else None

    def _heal(self, r: int) -> None:
        """Put this rank's up record back if a forger deleted or changed it (while it waits
        for its down record, every SLICE_S: before its parent's GRACE_S is out). One
        ``compare_set``: it writes the record where the key is missing."""
        if not self._mine:
            return
        key = self._key(r, "u", self.rank)
        now = self._mine_at.compare_set(key, "", self._mine)
        if now != self._mine.encode():
            log.warning("mirror round: this rank's record was changed by someone without "
                        "the job secret: put back")
            self._mine_at.set(key, self._mine)

    def _forget(self, keys: Sequence[str]) -> None:
        """Delete this rank's keys of a round it has finished (every reader has read
        them). Counted as store operations also where the counting store cannot pass a
        delete on (``--deadpool-count-work``: torch's Python store has no deleteKey for a
        PrefixStore over it; there the keys stay, as every round's did before issue 57)."""
        for key in keys:
            try:
                self._mine_at.delete_key(key)
            except RuntimeError as exc:
                if "pure virtual" not in str(exc):
                    raise
                counts.add("record_store_ops" if self._on_nodes else "store_ops")
        self._mine = ""


READY_KEY = "ready/"  # the ready barrier's keys (control/steps.py Agree.ready)


def barrier(store, rank: int, world_size: int, timeout_s: float, secret: Optional[str],
            gen: int, prefix: str, at: Optional[Callable[[int], Any]] = None,
            check: Callable[[], None] = lambda: None, slice_s: Optional[float] = None) -> None:
    """Every member of generation ``gen`` reached this point: one round of the tree with
    nothing posted, under keys of its own (``prefix``: READY_KEY, world.py's ARRIVE_KEY).
    Each rank does O(FANOUT) store operations on its own node's and its parent's record
    stores (``at``), plus the looks of its waits and one ``compare_set`` per ``slice_s``, and
    none on the job's store, at any W (issue 57: the rendezvous and ready barriers were
    counters and polls on the job's store, 4 and 6 operations per rank per recovery). A
    member that never arrives leaves the others waiting until the abort (a newer
    generation, the job's stop), ``check()`` raising (called every ``slice_s`` a wait
    lasts), or ``timeout_s``: TransportTimeout. A forged record fails the barrier for
    every member (ForgedRecordError), as any round but a vote."""
    StoreRounds(store, rank, world_size, timeout_s, secret, gen, at=at, prefix=prefix,
                check=check, slice_s=slice_s).round(what=prefix.rstrip("/"), shared=True)


def _merge(into: dict, body: Mapping[str, Any]) -> None:
    """A child's subtree record into this rank's: posts appended, adds summed, reads and
    counters united, forged ranks named."""
    for topic, posted in body.get("posts", {}).items():
        into["posts"].setdefault(topic, []).extend(posted)
    for name, amount in body.get("adds", {}).items():
        into["adds"][name] = into["adds"].get(name, 0) + int(amount)
    into["reads"] = sorted(set(into["reads"]) | set(body.get("reads", ())))
    into["counts"] = sorted(set(into["counts"]) | set(body.get("counts", ())))
    into["forged"].update(body.get("forged", {}))


def _part(down: Mapping[str, Any], reads: Sequence[str], counters: Sequence[str]) -> dict:
    """The part of a down record that a subtree reading ``reads`` and ``counters`` needs."""
    return {"posts": {t: down["posts"].get(t, []) for t in reads},
            "counts": {c: down["counts"].get(c, 0) for c in counters},
            "forged": down["forged"]}
