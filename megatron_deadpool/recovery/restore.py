"""Which iteration to restore, and where each rank's state comes from (``choose_restore``,
pure: a function of what every process of the new world holds), agreed without gathering
every inventory (``agree``: each rank learns only what concerns it, in store rounds of O(K)
operations), then doing it (``Restore``: agree on it, transfer, verify, load; one recovery
step each).

    inventory of rank r:  own     iterations of r's own snapshot slots (a spare: none)
                          copies  {owner rank: iterations} of buddy copies r holds,
                                  from any earlier placement (old copies stay valid until a
                                  newer iteration is committed)
                          committed  the last iteration r saw committed

    rank:        0        1        2 (spare)   3
    own:        {6,7}    {6,7}     {}          {6}
    copies:     {2:{6}}  {3:{6}}   {}          {0:{6}}      -> restore 6; rank 2 from rank 0

The restored iteration is the newest one for which every rank's state exists somewhere: in
its own slot, or as a verified copy in some other process. Rank ids are stable across
generations (a spare takes the dead rank's id), so a copy of owner o is what rank o needs.
A second failure during recovery simply gathers again: nothing is dropped before a newer
iteration commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..base.errors import ConfigError, NoCommittedStateError


@dataclass(frozen=True)
class Inventory:
    own: frozenset
    copies: Mapping[int, frozenset]
    committed: int = -1

    @classmethod
    def from_json(cls, d: dict) -> "Inventory":
        return cls(own=frozenset(d.get("own", ())),
                   copies={int(o): frozenset(its) for o, its in d.get("copies", {}).items()},
                   committed=int(d.get("committed", -1)))

    def to_json(self) -> dict:
        return {"own": sorted(self.own), "committed": self.committed,
                "copies": {str(o): sorted(its) for o, its in self.copies.items()}}


@dataclass(frozen=True)
class RestoreDecision:
    iteration: int
    sources: Dict[int, int]  # rank lacking its own copy -> rank that sends it

    def serves(self, rank: int) -> List[int]:
        """Owners whose copy ``rank`` must send (to the rank of the same id)."""
        return sorted(o for o, h in self.sources.items() if h == rank)


def choose_restore(inventories: Sequence[Inventory]) -> RestoreDecision:
    """``inventories[r]`` is rank r's. Raises NoCommittedStateError naming the last
    committed iteration when no iteration is held for every rank."""
    world = len(inventories)
    candidates = set()
    for inv in inventories:
        candidates |= inv.own
        for its in inv.copies.values():
            candidates |= its
    for it in sorted(candidates, reverse=True):
        sources = {}
        for r in range(world):
            if it in inventories[r].own:
                continue
            holders = [h for h in range(world)
                       if h != r and it in inventories[h].copies.get(r, ())]
            if not holders:
                break
            sources[r] = holders[0]
        else:
            return RestoreDecision(iteration=it, sources=sources)
    last = max((inv.committed for inv in inventories), default=-1)
    lost = [r for r in range(world) if not inventories[r].own
            and not any(inventories[h].copies.get(r) for h in range(world) if h != r)]
    who = f"the state of rank(s) {lost} is held by no living process (a rank and every " \
          f"buddy holding its copy failed together)" if lost else \
          "no single iteration is held for every rank"
    raise NoCommittedStateError(f"cannot restore from memory: {who}; last committed "
                                f"iteration {last}")


def coverable(own, holders: Mapping[int, frozenset]) -> frozenset:
    """The iterations of a rank's state that exist somewhere: its own slots, or a copy held
    by another rank (``holders``: holder -> iterations of this rank's copies it holds)."""
    out = set(own)
    for its in holders.values():
        out |= its
    return frozenset(out)


def source_of(chosen: int, own, holders: Mapping[int, frozenset]) -> Optional[int]:
    """Where a rank's state of ``chosen`` comes from: None (its own slot) or the lowest
    holder of it, as ``choose_restore`` picks."""
    if chosen in own:
        return None
    return min(h for h, its in holders.items() if chosen in its)


def agree(rounds, rank: int, inv: Inventory) -> Tuple[RestoreDecision, frozenset]:
    """``choose_restore``'s decision, as far as this rank needs it, in three store rounds
    of O(K) operations each (mirror/rounds.py): holders tell each owner what they hold of it;
    each rank adds itself to the counter of every iteration it can be restored at, and the
    newest iteration all W ranks counted is chosen; each rank lacking its own copy tells its
    holder. Returns the decision restricted to this rank (``sources``: its own source, and
    the owners it serves) and the (owner, holder) pairs around it that already hold the
    chosen iteration (they are not sent again). Every post and count is summed from signed
    records (rounds.py): a forged one stops the restore with ForgedRecordError, never with
    NoCommittedStateError, which means that the state is gone."""
    posts = {f"holds/{o}": sorted(its) for o, its in inv.copies.items() if o != rank and its}
    got, _ = rounds.round(posts=posts, read_posts=[f"holds/{rank}"], what="restore")
    holders = {h: frozenset(its) for h, its in got[f"holds/{rank}"]}
    cover = coverable(inv.own, holders)
    got, n = rounds.round(posts={} if cover else {"lost": rank},
                          adds={f"cover/{it}": 1 for it in cover}, read_posts=["lost"],
                          read_counts=[f"cover/{it}" for it in cover], what="restore")
    full = [it for it in cover if n[f"cover/{it}"] == rounds.world_size]
    if not full:
        lost = sorted(r for r, _ in got["lost"])
        who = (f"the state of rank(s) {lost} is held by no living process (a rank and every "
               "buddy holding its copy failed together)" if lost else
               "no single iteration is held for every rank")
        # every rank is here (the counts are the same for all): one more round, O(W) reads,
        # names the newest iteration any rank saw committed; the job stops after it anyway
        got, _ = rounds.round(posts={"committed": inv.committed}, read_posts=["committed"],
                              what="restore")
        last = max(c for _, c in got["committed"])
        raise NoCommittedStateError(f"cannot restore from memory: {who}; last committed "
                                    f"iteration {last}")
    chosen = max(full)
    src = source_of(chosen, inv.own, holders)
    got, _ = rounds.round(posts={f"needs/{src}": chosen} if src is not None else {},
                          read_posts=[f"needs/{rank}"], what="restore")
    sources = {o: rank for o, _ in got[f"needs/{rank}"]}
    if src is not None:
        sources[rank] = src
    held = {(rank, h) for h, its in holders.items() if chosen in its}
    held |= {(o, rank) for o, its in inv.copies.items() if chosen in its}
    return RestoreDecision(iteration=chosen, sources=sources), frozenset(held)


@dataclass
class Restore:
    """One rank's restore, carried through the four steps a recovery runs one by one
    (control/steps.py ``RESTORE``), each a function here using what the one before found:

        agree_on  the iteration, and who sends which copy (``agree``: store rounds, O(K))
        transfer  the copies this rank serves sent; its own received if it lacks it
        verify    its own copy checked: header, layout, checksum (mirror/snapshot.py)
        load      loaded into the live tensors and the model, applied (``apply``, the
                  attachment's), and re-protected

    ``run`` does the four in a row, outside a recovery (tests, scripts/gpu_mirror_bench.py)."""

    mirror: object                        # mirror.mirror.Mirror
    optimizer: object
    model: object
    rank: int
    rounds: object                        # the generation's store rounds (mirror/rounds.py)
    apply: Callable[[dict], None]         # the restored metadata, to the train state
    decision: Optional[RestoreDecision] = None
    held: frozenset = frozenset()         # (owner, holder) pairs that are not sent again
    meta: Optional[dict] = None

    @property
    def iteration(self) -> int:
        return self.decision.iteration


def agree_on(r: Restore) -> int:
    inv = Inventory.from_json(r.mirror.exchange.inventory())
    r.decision, r.held = agree(r.rounds, r.rank, inv)
    return r.iteration


def transfer(r: Restore) -> None:
    d = r.decision
    if r.rank in d.sources:
        create_optimizer_state(r.optimizer)
    r.mirror.exchange.transfer_for_restore(d.iteration, d.serves(r.rank),
                                           d.sources.get(r.rank))


def verify(r: Restore) -> dict:
    """Nothing reaches the live tensors here: a copy refused is never loaded."""
    r.meta = r.mirror.verify_local(r.iteration)
    return r.meta


def load(r: Restore) -> int:
    """Returns the restored iteration."""
    # Buddies that already hold the restored iteration (same placement) are not re-sent.
    _load(r.mirror, r.optimizer, r.model, r.iteration, r.meta, r.held)
    r.apply(r.meta)
    return r.iteration


def run(r: Restore) -> int:
    """The four steps in a row; returns the restored iteration."""
    agree_on(r)
    transfer(r)
    verify(r)
    return load(r)


def resume(mirror, optimizer, model, root: str, layout: tuple) -> Tuple[int, dict]:
    """``--deadpool-resume``: every rank loads its own saved slot of the newest iteration
    saved for all ranks of this ``layout`` (world, tp, pp, dp) that every rank verifies
    (``mirror/persist.py``), exactly as a spare loads a buddy's copy."""
    from ..base.errors import MirrorCorruptError
    from ..mirror import persist

    saved = persist.scan(root)
    candidates = persist.resume_candidates(saved, layout)
    create_optimizer_state(optimizer)

    def load_own(key) -> Optional[str]:
        try:
            persist.adopt(mirror, persist.read_slot(saved.path(key, mirror.rank)), key[0],
                          saved.manifests[key].job)
        except (OSError, MirrorCorruptError, ConfigError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    chosen = persist.resume_from(candidates, load_own, mirror.exchange.all_ok)[0]
    meta = mirror.verify_local(chosen)
    _load(mirror, optimizer, model, chosen, meta, frozenset())
    return chosen, meta


def create_optimizer_state(optimizer) -> None:
    """A rank without a step behind it (a spare, a resumed job) creates the state the copy
    fills."""
    from ..adapters import shard

    for opt in shard.distributed_optimizers(optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _load(mirror, optimizer, model, chosen: int, meta: dict, skip) -> None:
    """The verified copy of ``chosen`` into the live tensors; the optimizer's state reset if
    the copy has none, the model's params from the restored main params, and ``chosen``
    re-protected."""
    from ..adapters import shard

    mirror.load_local(chosen)
    if meta.get("optimizer_state_empty"):
        shard.reset_optimizer_state(optimizer)  # the initial commit: before step 1
    shard.copy_main_params_to_model(optimizer, model)
    mirror.exchange.reprotect(chosen, skip=skip)  # drops what is newer first
