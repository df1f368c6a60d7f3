"""The mirror's collectives as rounds on the generation's store, so that no world-sized gloo
group is built for them (issue 39: per survivor, the mirror's connections and messages are
O(K), independent of W), each value signed with the job secret (issue 49: a client of the
store without the secret can forge no vote, size or count).

A round, for rank x of W::

    x:       set m/{x} = its signed record (posts, adds, what it reads)
             add {r}/arrived; the W-th to arrive sets {r}/open
    rank 0:  waits for {r}/open, reads every m/{y} (one multi_get), verifies each, sums the
             adds and sorts the posts, writes each member's signed result res/{y} (one
             multi_set; res/all when every member reads the same) and sets {r}/done
    x:       waits for {r}/done, reads res/{x}, verifies it

A survivor does four store operations per round (set, add, check, get) and its waits,
whatever W; rank 0 reads and writes O(W) bytes in two operations more (the store server did
O(W) per round already). Rounds are numbered per generation, and every member runs the same
rounds in the same order (the mirror's calls are collective, as they were on a gloo group).

    all_ok(flag)            an AND: the sum of the members' "false" adds
    gather_from(v, ranks)   the values of ``ranks`` only (a holder's owners' slot sizes)
    all_gather_json(obj)    every member's value (O(W) bytes to each): kept for the
                            interface, not on the recovery's path

Forgery (round_records.py has the records). The counter ``{r}/arrived`` and the keys
``{r}/open`` and ``{r}/done`` are wake-ups only: no value is taken from them. Only verified
records are summed. A record that fails its MAC or is signed for another slot, and one that
is missing or of an older round once the arrival count reads W (its writer wrote this
round's before it arrived: a forger deleted it or put an older one back), is forged once it
has stayed so for ``GRACE_S`` (a genuine writer may still overwrite a forger's early write);
the round then fails with ForgedRecordError naming the ranks, on every member. ``all_ok``
takes that as a "no" vote (the iteration does not commit, the job goes on); every other
round stops the recovery with it, never with NoCommittedStateError. An arrival count moved
back delays a round by ``SLICE_S`` at most (rank 0 looks at the records that often while it
waits); one moved forward, or a {r}/open or {r}/done set early, costs polling, and a
forgery stop if a member is then slower than ``GRACE_S``.

A member that dies leaves the others waiting until ``timeout_s`` (a ``TransportTimeout``)
or until the abort shuts the generation's store connection down.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..base import counts
from ..base.errors import ForgedRecordError, TransportTimeout
from . import round_records as rr

log = logging.getLogger(__name__)

PREFIX = "mirror/rounds/"
AGGREGATOR = 0
GRACE_S = 2.0    # a forged record that stays forged this long fails the round
SLICE_S = 1.0    # rank 0 looks at the records this often while it waits for {r}/open
POLL_S = 0.005   # while a record is stale or forged (the first wait; doubling to 50 ms)


def _waited(store, keys: Sequence[str], seconds: float) -> bool:
    """``store.wait(keys)``: False on its timeout."""
    try:
        store.wait(list(keys), timedelta(seconds=max(seconds, 1e-3)))
        return True
    except Exception as exc:  # noqa: BLE001 - torch's store error types vary by version
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            return False
        raise


class StoreRounds:
    kind = "store"

    def __init__(self, store, rank: int, world_size: int, timeout_s: float = 600.0,
                 secret: Optional[str] = None, gen: int = 0):
        """``store``: this generation's (a key written in one generation is never read in
        another: world.py prefixes the store per generation); ``secret``, ``gen``: the job's
        and this generation's, bound into every record (None: an empty key, for tests that
        run the rounds alone; the runtime always passes the job's)."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.secret, self.gen = secret or "", gen
        self._round = 0
        self._mine = ""  # this rank's record of the current round (put back if changed)

    def round(self, posts: Mapping[str, Any] = {}, adds: Mapping[str, int] = {},
              read_posts: Sequence[str] = (), read_counts: Sequence[str] = (),
              timeout_s: Optional[float] = None, what: str = "round", shared: bool = False
              ) -> Tuple[Dict[str, List[Tuple[int, Any]]], Dict[str, int]]:
        """Post ``posts`` (topic -> JSON value), add ``adds`` (counter -> amount), wait for
        every member, then return the posts of ``read_posts`` (topic -> [(poster, value)],
        by poster) and the totals of ``read_counts``. ``shared``: every member reads the
        same (one result record for all). Raises ForgedRecordError (module docstring)."""
        self._round += 1
        r, store = self._round, self.store
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        record = rr.member(self.secret, self.gen, r, what, self.rank, posts, adds,
                           () if shared else read_posts, () if shared else read_counts)
        store.set(self._key(f"m/{self.rank}"), record)
        if store.add(self._key(f"{r}/arrived"), 1) == self.world_size:
            store.set(self._key(f"{r}/open"), "1")
        counts.add("messages", 2)
        counts.add("bytes", len(record))
        self._mine = record
        if self.rank == AGGREGATOR:
            body = self._aggregate(r, what, deadline, limit,
                                   (read_posts, read_counts) if shared else None)
        else:
            body = self._result(r, what, deadline, limit, shared)
        if body["forged"]:
            raise ForgedRecordError(rr.forged_message(what, r, body["forged"]))
        return ({t: [tuple(p) for p in body["posts"].get(t, [])] for t in read_posts},
                {c: int(body["counts"].get(c, 0)) for c in read_counts})

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
    def _key(self, name: str) -> str:
        return f"{PREFIX}{name}"

    def _timeout(self, what: str, limit: float, why: str = "") -> TransportTimeout:
        return TransportTimeout(f"mirror {what}: not every member arrived in {limit:g}s{why}")

    def _aggregate(self, r: int, what: str, deadline: float, limit: float,
                   shared: Optional[Tuple[Sequence[str], Sequence[str]]]) -> dict:
        """Rank 0: every member's verified record, summed into each member's signed result
        (written before {r}/done is set). Returns rank 0's own."""
        store, opened = self.store, self._key(f"{r}/open")
        while not _waited(store, [opened], min(SLICE_S, deadline - time.monotonic())):
            self._heal()
            got = self._records(r, what)
            if all(why != rr.STALE for _, why in got.values()):  # each in, or forged
                self._arrivals_moved(r, what)
                break
            if time.monotonic() >= deadline:
                raise self._timeout(what, limit)
        members, forged = self._collect(r, what, deadline, limit)
        out = rr.results(members, forged, self.world_size, shared)
        names = {x: self._key(f"res/{x}") for x in out}
        sealed = {x: rr.seal(self.secret, "result", self.gen, r, what, to=x, **body)
                  for x, body in out.items()}
        store.multi_set([names[x] for x in out], [sealed[x] for x in out])
        store.set(self._key(f"{r}/done"), "1")
        counts.add("messages", 2 + len(out))
        counts.add("bytes", sum(len(v) for v in sealed.values()))
        return out["all" if shared is not None else AGGREGATOR]

    def _records(self, r: int, what: str) -> Dict[int, Tuple[Optional[dict], str]]:
        keys = [self._key(f"m/{x}") for x in range(self.world_size)]
        raws = self.store.multi_get(keys) if self.store.check(keys) else [
            self.store.get(k) if self.store.check([k]) else None for k in keys]
        counts.add("messages", 1 + self.world_size)
        return {x: rr.check(self.secret, self._mine if x == self.rank else raw, "member",
                            self.gen, r, what, **{"from": x}) for x, raw in enumerate(raws)}


    def _heal(self) -> None:
        """Put this rank's record back if a forger deleted or changed it (while it waits,
        every SLICE_S: rank 0 takes it then, before a forged one is due)."""
        key = self._key(f"m/{self.rank}")
        raw = self.store.get(key) if self.store.check([key]) else None
        if raw != self._mine.encode():
            log.warning("mirror round: this rank's record was %s by someone without the job "
                        "secret: put back", "deleted" if raw is None else "changed")
            self.store.set(key, self._mine)

    def _arrivals_moved(self, r: int, what: str) -> None:
        """Every record of round ``r`` is in (or forged), and {r}/open is not set: logged
        when the arrival count says fewer than W arrived (a forger moved it; else the last
        member is between its add and its set)."""
        n = self.store.add(self._key(f"{r}/arrived"), 0)
        if n < self.world_size:
            log.warning("mirror %s (round %d): every member's record is in but the arrival "
                        "count reads %d of %d: moved by someone without the job secret (the "
                        "count is ignored)", what, r, n, self.world_size)

    def _collect(self, r: int, what: str, deadline: float, limit: float
                 ) -> Tuple[Dict[int, dict], Dict[int, str]]:
        """Every member's record of round ``r``, and the ranks whose record is still forged,
        missing or of an older round GRACE_S after it should be in (a forged one at once; a
        missing or older one once the arrival count reads W: its writer wrote this round's
        before it arrived, so a forger put an older one back or deleted it)."""
        since, pause = None, POLL_S
        while True:
            got = self._records(r, what)
            bad = {x: why for x, (body, why) in got.items() if body is None}
            if not bad:
                return {x: body for x, (body, _) in got.items()}, {}
            now = time.monotonic()
            due = any(why != rr.STALE for why in bad.values()) or \
                self.store.add(self._key(f"{r}/arrived"), 0) >= self.world_size
            since = (since or now) if due else None
            if due and now - since >= min(GRACE_S, max(deadline - now, 0)):
                return ({x: body for x, (body, _) in got.items() if body is not None},
                        {x: why if why != rr.STALE else "missing, or an older round's record "
                         "put back after it arrived" for x, why in bad.items()})
            if now >= deadline:
                raise self._timeout(what, limit, f" (no record of this round from ranks "
                                    f"{sorted(bad)})")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _result(self, r: int, what: str, deadline: float, limit: float, shared: bool) -> dict:
        """This rank's result of round ``r``, once rank 0 has written it (it sets {r}/done
        after): verified; forged once it has been forged, missing or of an older round for
        GRACE_S after {r}/done (a forger wrote over it, or set {r}/done early)."""
        store, to = self.store, "all" if shared else self.rank
        key = self._key(f"res/{to}")
        while not _waited(store, [self._key(f"{r}/done")],
                          min(SLICE_S, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise self._timeout(what, limit)
            self._heal()
        since, pause = time.monotonic(), POLL_S
        while True:
            raw = store.get(key) if store.check([key]) else None
            counts.add("messages")
            body, why = rr.check(self.secret, raw, "result", self.gen, r, what, to=to)
            if body is not None:
                return body
            if time.monotonic() - since >= GRACE_S:
                why = why if why != rr.STALE else "missing, or an older round's"
                raise ForgedRecordError(rr.forged_message(what, r, {to: f"its result: {why}"}))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
