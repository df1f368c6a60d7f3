"""Keep the groups a failure did not break; rebuild only the others (issue 51).

A recovery used to destroy every communicator and replay ``initialize_model_parallel``
from nothing. On a gloo world a survivor now keeps its torch registry across the
generation, and the replay goes through ``repairing``: every ``new_group`` call megatron
makes is matched by its key (sorted members, named backend, occurrence) against the group
that the last complete build made for the same call, and that group is kept when all its
members vote to keep it:

  * none of its ranks is in the plan's ``failed_ranks`` (every rank knows it: no vote, the
    group is rebuilt with the spare in the dead rank's place);
  * every member holds it from the same build (the same c10d name; the same process at
    every rank as when it was built);
  * every member's tally of its operations agrees (group_ops.py): the same collectives,
    none unfinished, and in a group of two the same messages each way. A group that the
    failure caught with collectives in flight (issued by some members, never by the
    others, all of them alive) is completed first when it can be (issue 57, ``_complete``):
    the members that never issued them issue the same ones on zeros, described by their
    issuers in the votes' round; once they finished everywhere and every account agrees, it is kept. Any
    other operation in flight (point-to-point, a collective that cannot be described, more
    than group_ops.RECENT) and a completion that does not finish in COMPLETE_S: rebuilt.

The votes are one signed store round for all the groups at once (``settle``, before the
replay; mirror/rounds.py: a tree of fan-out 4, every record sealed with the job secret,
at most ``rounds.MAX_OPS_PER_ROUND`` store operations per rank, at any W and any number of
groups). Each member of each group that held no lost rank adds, under the group's topic,
an arrival (1, or 1 + ``NO`` if it cannot keep the group) and its account's 60-bit hash h;
every member reads the group's two totals, the same on every member, and keeps the group
iff the arrivals are exactly ``size`` (all came, none said no) and the hashes sum to
``size`` times its own (all equal: a different account that made the mean its own hash by
chance, 2^-60, is the only way two members could decide apart). A record forged or changed by a store client without the secret fails
the round on every member (ForgedRecordError): then every group is rebuilt, and the
forged record is named in the log. (Before issue 58: one unsigned round per group,
``compare_set``, ``add``, ``set``, ``wait``, ``get``: four or five operations per member
and group, and a written ``keep`` kept an unsettled group.) A call this rank is not a member of makes nothing and does not reach
torch's ``new_group`` (which would make nothing either: torch connects only members and
``TORCH_DIST_INIT_BARRIER`` is off), so a rank's replay costs O(groups it is in) in torch,
not O(every group of the job). Every group made in a replay gets a c10d name
fixed by its generation and call index (``name_next``), so that a promoted spare, whose
process has no history, and the survivors, whose counters moved, name it alike.

    abort (default group's connections) ─► retire (megatron forgets; nothing destroyed)
    ─► rendezvous (new default group) ─► settle (one signed round: every group's verdict;
    which carries the descriptions of collectives caught in flight; one more only when a
    group was caught so: its collectives completed, re-voted)
    ─► replay: kept | rebuilt ─► dropped groups:
    connections shut, unregistered, handed to the reaper
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Set, Tuple

from ..base import counts
from ..base.errors import ForgedRecordError
from . import abort as ab
from . import gloo_waits, group_ops

NAME_SPAN = 100_000        # c10d names of generation g's groups: g * NAME_SPAN + index
DEFAULT_AT = NAME_SPAN - 1  # the default group's index
AFTER_REPLAY = NAME_SPAN // 2  # groups made after the replay (the mirror's gloo group)

Key = Tuple[Tuple[int, ...], str, int]
log = logging.getLogger(__name__)


@dataclass
class Book:
    """The groups of this process's last complete build of megatron's groups, by call key;
    the process (lid) at each rank then; each group's socket inodes (its connections)."""

    groups: Dict[Key, object] = field(default_factory=dict)
    lids: Dict[int, int] = field(default_factory=dict)
    sockets: Dict[int, Set[int]] = field(default_factory=dict)  # id(group) -> inodes

    def inodes(self) -> Set[int]:
        return set().union(*self.sockets.values()) if self.sockets else set()


def name_next(gen: int, index: int) -> None:
    """The next group torch names gets the c10d name ``gen * NAME_SPAN + index``."""
    from torch.distributed import distributed_c10d as c10d

    c10d._world.group_count = gen * NAME_SPAN + index


def topic(key: "Key") -> str:
    """A group's topic in the settling round: short, the same on every member."""
    members, backend, n = key
    return "g" + hashlib.sha256(f"{members}|{backend}|{n}".encode()).hexdigest()[:16]


NO = 1 << 20  # a member's "no", added to its group's arrivals
PEND = NO * NO  # a member's "I issued collectives on it that are still in flight"
PENDING = "in-flight"  # the round's counter of such groups, every member's summed
COMPLETE_S = 0.5  # how long a member waits for the collectives it completes to finish


def account_hash(account: str) -> int:
    return int(hashlib.sha256(account.encode()).hexdigest()[:15], 16)


@dataclass
class Replay:
    """One replay of megatron's ``new_group`` calls on this rank (``call`` is each one)."""

    gen: int
    me: int
    lids: Dict[int, int]            # rank -> lid in the plan being formed
    failed: Set[int]                # the plan's failed ranks
    old: Book
    rounds: object = None           # the votes' signed rounds (the generation's); None: none
    new: Book = field(default_factory=Book)
    calls: int = 0
    seen: Dict[tuple, int] = field(default_factory=dict)
    verdicts: Dict[Key, bool] = field(default_factory=dict)  # settle's: key -> keep

    def settle(self) -> None:
        """Every old group's verdict in one signed round (module docstring). Every rank of
        the generation takes part, a promoted spare too (it holds no old group: it adds
        nothing). A forged record: every group is rebuilt, on every member alike. A group
        caught with collectives in flight that the members which never issued them can
        issue is completed first: its issuers post the descriptions in this round, and
        ``_complete`` takes one more round, only then."""
        if self.rounds is None:
            return
        adds, mine, flying, posts = {}, {}, {}, {}
        for key, old in self.old.groups.items():
            members, backend, _ = key
            if set(members) & self.failed or backend not in ("", "gloo"):
                continue
            _close_finished(old)
            same = all(self.old.lids.get(r) == self.lids.get(r) for r in members)
            account = group_ops.digest(old.group_name, self.me, members) if same else "new"
            caught = group_ops.in_flight(old.group_name) if same else None
            t = topic(key)
            if caught is not None:  # agreed on without them; they are completed below
                account, flying[key] = caught
                posts[f"{t}/d"] = flying[key]
            h = account_hash(account)
            adds.update({f"{t}/n": 1 + (PEND if caught else 0 if account.startswith("keep")
                                        else NO), f"{t}/s": h})
            mine[key] = h
        if flying:
            adds[PENDING] = len(flying)
        try:
            got, n = self.rounds.round(
                posts=posts, adds=adds, read_posts=[f"{topic(k)}/d" for k in mine],
                read_counts=sorted(set(adds) | {PENDING}), what="keep")
        except ForgedRecordError as exc:
            log.warning("%s: every group is rebuilt", exc)
            return
        completing = {}
        for key, h in mine.items():
            size, t = len(key[0]), topic(key)
            arrived = n[f"{t}/n"]
            agree = arrived % NO == size and arrived // NO % NO == 0 and \
                n[f"{t}/s"] == size * h
            self.verdicts[key] = agree and arrived < PEND
            if agree and arrived >= PEND:
                completing[key] = arrived // PEND  # the members that issued them
        if n[PENDING]:  # every rank reads the same total: all take part, or none
            self._complete(completing, flying, got)

    def _complete(self, completing: Dict[Key, int], flying: Dict[Key, list],
                  got: Dict[str, list]) -> None:
        """The groups whose members agree but for collectives some of them issued and the
        others never did (the failure caught them in flight: a data-parallel reduce-scatter
        that the dead ranks' pipeline partners never joined). The members that issued them
        posted their descriptions in round "keep" (``got``); the others issue the same on
        zeros (gloo_waits.issue_again), so that they finish everywhere; each member waits
        for them at most COMPLETE_S. Round "keep-done": every member's account again; the
        group is kept iff they all agree, else rebuilt as before. The results are never
        read: the iteration they belonged to is done again from the restored state."""
        deadline, works = time.monotonic() + COMPLETE_S, {}
        for key in completing:
            if key not in flying:
                works[key] = _issue(self.old.groups[key], got.get(f"{topic(key)}/d", []),
                                    completing[key])
        adds, mine = {}, {}
        for key in completing:
            old = self.old.groups[key]
            ok = _finished(old, works.get(key), key in flying, deadline)
            account = group_ops.digest(old.group_name, self.me, key[0]) if ok else "unfinished"
            h, t = account_hash(account), topic(key)
            adds.update({f"{t}/m": 1 + (0 if account.startswith("keep") else NO),
                         f"{t}/z": h})
            mine[key] = h
        try:
            _, n = self.rounds.round(adds=adds, read_counts=sorted(adds), what="keep-done")
        except ForgedRecordError as exc:
            log.warning("%s: the groups caught in flight are rebuilt", exc)
            return
        for key, h in mine.items():
            size, t = len(key[0]), topic(key)
            self.verdicts[key] = n[f"{t}/m"] == size and n[f"{t}/z"] == size * h
            if self.verdicts[key]:
                counts.add("groups_completed")

    def call(self, original, arguments: dict, args, kwargs):
        import torch.distributed as dist

        ranks = arguments.get("ranks")
        members = tuple(sorted(ranks)) if ranks is not None else \
            tuple(range(dist.get_world_size()))
        backend = str(arguments.get("backend") or "").lower()
        n = self.seen[(members, backend)] = self.seen.get((members, backend), -1) + 1
        key, index = (members, backend, n), self.calls
        self.calls += 1
        name = str(self.gen * NAME_SPAN + index)
        if self.me not in members:  # nothing is made, torch is not called: its name is
            name_next(self.gen, index + 1)  # skipped alike (what torch's count would be)
            return dist.GroupMember.NON_GROUP_MEMBER
        old = self.old.groups.get(key)
        if old is not None and self.verdicts.get(key):
            self.new.groups[key] = old
            self.new.sockets[id(old)] = self.old.sockets.get(id(old), set())
            counts.add("groups_kept")
            counts.add("kept_members", len(members))
            return old
        name_next(self.gen, index)
        before, ops_before = set(ab.socket_inodes()), counts.snapshot()["store_ops"]
        group = original(*args, **kwargs)
        self.new.groups[key] = group
        self.new.sockets[id(group)] = set(ab.socket_inodes()) - before
        if self.old.groups:  # a survivor's rebuild, not a first build
            dead = bool(set(members) & self.failed)
            _count_rebuilt(len(members), unsettled=not dead)
            if dead:  # the dead ranks' own group: apart, so the rest is what is not
                _count_dead(len(members), counts.snapshot()["store_ops"] - ops_before)
        return group

    def dropped(self) -> List[object]:
        """The old build's groups this replay did not keep (each once)."""
        kept = {id(g) for g in self.new.groups.values()}
        out, seen = [], set()
        for g in self.old.groups.values():
            if id(g) not in kept and id(g) not in seen:
                seen.add(id(g))
                out.append(g)
        return out


def _count_rebuilt(size: int, unsettled: bool, lazy: bool = False) -> None:
    """``lazy``: a group that connects on first use (a recovery's default group)."""
    links = 0 if lazy else size - 1
    counts.add("groups_rebuilt")
    counts.add("rebuilt_members", size)
    counts.add("rebuilt_connections", links)
    if unsettled:  # no member failed: an operation was in flight on it
        counts.add("rebuilt_unsettled")
        counts.add("unsettled_connections", links)


def _issue(group, posted: List[Tuple[int, object]], issuers: int) -> Optional[list]:
    """(a member that never issued them) the collectives that the ``issuers`` members which
    did posted, issued on ``group``; None if the posts are not all there and all alike, or
    cannot be issued (the group is then not completed: rebuilt)."""
    descs = {json.dumps(v) for _, v in posted}
    if len(posted) != issuers or len(descs) != 1:
        log.warning("group %s: %d of %d descriptions of its collectives in flight, %d "
                    "different: rebuilt", getattr(group, "group_name", "?"), len(posted),
                    issuers, len(descs))
        return None
    try:
        return [w for d in json.loads(descs.pop()) for w in gloo_waits.issue_again(group, d)]
    except Exception as exc:  # noqa: BLE001 - any failure here means: rebuild it
        log.warning("group %s: its collectives in flight not issued again (%s): rebuilt",
                    getattr(group, "group_name", "?"), exc)
        return None


def _close_finished(group) -> None:
    """Works issued asynchronously and never waited on count as open in the tally, though
    gloo may have finished them long ago (--overlap-param-gather's all-gathers are waited
    on lazily): each is waited on for at most 5 ms, so that only the truly unfinished stay
    open (else a finished one was taken for the one in flight, and completing the group
    waited COMPLETE_S in vain)."""
    for w in group_ops.works_of(getattr(group, "group_name", None)):
        if w.never_waited():
            w.wait_for(0.005)


def _finished(group, works: Optional[list], issued_before: bool, deadline: float) -> bool:
    """Whether the collectives in flight on ``group`` finished here by ``deadline``: a
    member that issued them before the failure waits for its tally to show none open (its
    abandoned waits' waiter threads close them as gloo finishes); one that issued them now
    waits for its own works."""
    if not issued_before:
        return works is not None and all(
            w.wait_for(deadline - time.monotonic()) for w in works if w is not None)
    for w in group_ops.works_of(group.group_name):  # issued asynchronously, and the
        if w.never_waited():                        # failure came before their wait
            w.wait_for(deadline - time.monotonic())
    while group_ops.open_count(group.group_name):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _count_dead(size: int, store_ops: int) -> None:
    """A group rebuilt because a member of it died (counts.DETAIL): its size, its gloo
    connections, and the store operations torch's creation of it made."""
    counts.add("dead_groups")
    counts.add("dead_group_members", size)
    counts.add("dead_group_connections", size - 1)
    counts.add("dead_group_store_ops", store_ops)


@contextlib.contextmanager
def repairing(replay: Replay):
    """Within the block, ``torch.distributed.new_group`` goes through ``replay.call``.
    Enter it before ``shared_gloo_groups``, which then wraps it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = dist.new_group
    signature = inspect.signature(distributed_c10d.new_group)

    def new_group(*args, **kwargs):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # not torch's signature: made as asked, never kept
            arguments = {"backend": "unknown"}
        return replay.call(original, arguments, args, kwargs)

    dist.new_group = new_group
    try:
        yield replay
    finally:
        dist.new_group = original
    name_next(replay.gen, AFTER_REPLAY)


def forget_default():
    """Take the default group out of torch's registry without destroying any other group
    (``destroy_process_group`` of the default group destroys them all); returns it."""
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._world.default_pg
    if pg is None:
        return None
    _unregister(pg)
    c10d._update_default_pg(None)
    return pg


def _unregister(pg) -> None:
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config,
                  w.pg_coalesce_state, w.pg_to_tag):
        table.pop(pg, None)
    for members in w.tags_to_pg.values():
        while pg in members:
            members.remove(pg)
    unregister = getattr(c10d, "_unregister_process_group", None)
    if unregister is not None:
        unregister(pg.group_name)


def unregister_others(kept: Set[int]) -> None:
    """Take every group torch knows out of its registry but the default group and those
    whose ids are in ``kept`` (the last build's: the replay decides on them). A group made
    outside megatron's build (the gloo mirror transport's) is its owner's to destroy."""
    from torch.distributed import distributed_c10d as c10d

    default = c10d._world.default_pg
    for pg in list(c10d._world.pg_map):
        if pg is not default and id(pg) not in kept:
            group_ops.forget(getattr(pg, "group_name", ""))
            _unregister(pg)


def drop(groups: List[object], book: Book, store_port: Optional[int]) -> int:
    """The groups a replay did not keep: their connections shut (an operation still queued
    on one fails now, not at its deadline), out of torch's registry; the caller hands them
    to the reaper. Returns the connections shut."""
    inodes: Set[int] = set()
    for g in groups:
        inodes |= book.sockets.get(id(g), set())
    shut = ab.shutdown_gloo_connections(store_port, inodes, with_store=False) \
        if store_port else 0
    for g in groups:
        group_ops.forget(getattr(g, "group_name", ""))
        _unregister(g)
    return shut
