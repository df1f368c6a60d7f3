"""The mirror's collectives as rounds on the generation's store, so that no world-sized gloo
group is built for them (issue 39: per survivor, the mirror's connections and messages are
O(K), independent of W).

A round is: post to topics, add to counters, wait for every member, then read the topics
and counters this rank needs. Its cost for one rank is one store operation per post, add
and read, plus two for the barrier (one ``add`` to count arrivals; the last to arrive opens
the round, the others ``wait`` for that key); the store server does O(W) per round. Rounds
are numbered per generation, and every member runs the same rounds in the same order (the
mirror's calls are collective, as they were on a gloo group).

    all_ok(flag)            an AND: one counter of the members that said False
    gather_from(v, ranks)   the values of ``ranks`` only (a holder's owners' slot sizes)
    all_gather_json(obj)    every member's value, O(W) reads: kept for the interface,
                            not on the recovery's path

A member that dies leaves the others waiting in the barrier until ``timeout_s`` (a
``TransportTimeout``) or until the abort shuts the generation's store connection down.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..base import counts
from ..base.errors import TransportTimeout

PREFIX = "mirror/rounds/"


class StoreRounds:
    kind = "store"

    def __init__(self, store, rank: int, world_size: int, timeout_s: float = 600.0):
        """``store``: this generation's (a key written in one generation is never read in
        another: world.py prefixes the store per generation)."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self._round = 0

    def round(self, posts: Mapping[str, Any] = {}, adds: Mapping[str, int] = {},
              read_posts: Sequence[str] = (), read_counts: Sequence[str] = (),
              timeout_s: Optional[float] = None, what: str = "round"
              ) -> Tuple[Dict[str, List[Tuple[int, Any]]], Dict[str, int]]:
        """Post ``posts`` (topic -> JSON value), add ``adds`` (counter -> amount), wait for
        every member, then return the posts of ``read_posts`` (topic -> [(poster, value)],
        by poster) and the totals of ``read_counts``."""
        self._round += 1
        r, store = self._round, self.store
        for topic, value in posts.items():
            n = store.add(self._key(r, f"p/{topic}/n"), 1)
            data = json.dumps([self.rank, value])
            store.set(self._key(r, f"p/{topic}/{n}"), data)
            counts.add("messages")
            counts.add("bytes", len(data))
        for name, amount in adds.items():
            store.add(self._key(r, f"c/{name}"), int(amount))
            counts.add("messages")
        self._barrier(r, timeout_s, what)
        got = {t: sorted(self._read(r, t)) for t in read_posts}
        totals = {c: store.add(self._key(r, f"c/{c}"), 0) for c in read_counts}
        counts.add("messages", len(read_counts))
        return got, totals

    # ------------------------------------------------------------ the collectives
    def all_ok(self, ok: bool, timeout_s: Optional[float] = None) -> bool:
        _, n = self.round(adds={"false": 0 if ok else 1}, read_counts=["false"],
                          timeout_s=timeout_s, what="commit")
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
        got = self.gather_from(obj, range(self.world_size), timeout_s)
        return [got[x] for x in range(self.world_size)]

    def all_gather_int(self, value: int, timeout_s: Optional[float] = None) -> List[int]:
        return [int(v) for v in self.all_gather_json(int(value), timeout_s)]

    def release(self) -> None:
        """The generation is over: nothing to close (its keys went with its store prefix),
        nothing for the reaper."""
        return None

    # ------------------------------------------------------------ the store
    def _key(self, r: int, name: str) -> str:
        return f"{PREFIX}{r}/{name}"

    def _read(self, r: int, topic: str) -> List[Tuple[int, Any]]:
        n = self.store.add(self._key(r, f"p/{topic}/n"), 0)
        counts.add("messages", 1 + n)
        return [tuple(json.loads(self.store.get(self._key(r, f"p/{topic}/{i}"))))
                for i in range(1, n + 1)]

    def _barrier(self, r: int, timeout_s: Optional[float], what: str) -> None:
        """Every member has arrived at round ``r``: the last to arrive opens it. Keys are
        not deleted (a Python store that counts operations cannot forward ``delete_key``);
        a generation's rounds are few: attach, restore, re-protection, and one per step only
        with the collective commit (three small keys)."""
        store, opened = self.store, self._key(r, "open")
        counts.add("messages", 2)
        if store.add(self._key(r, "arrived"), 1) == self.world_size:
            store.set(opened, "1")
            return
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            store.wait([opened], timedelta(seconds=limit))
        except Exception as exc:  # noqa: BLE001 - torch's store error types vary by version
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise TransportTimeout(f"mirror {what}: not every member arrived in "
                                       f"{limit:g}s") from exc
            raise
