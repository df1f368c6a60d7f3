"""Which iteration to restore, and where each rank's state comes from. Pure: a function of
what every process of the new world holds, gathered right after the world is rebuilt.

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
from typing import Dict, List, Mapping, Sequence

from ..errors import NoCommittedStateError


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
class RestorePlan:
    iteration: int
    sources: Dict[int, int]  # rank lacking its own copy -> rank that sends it

    def serves(self, rank: int) -> List[int]:
        """Owners whose copy ``rank`` must send (to the rank of the same id)."""
        return sorted(o for o, h in self.sources.items() if h == rank)


def decide(inventories: Sequence[Inventory]) -> RestorePlan:
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
            return RestorePlan(iteration=it, sources=sources)
    last = max((inv.committed for inv in inventories), default=-1)
    lost = [r for r in range(world) if not inventories[r].own
            and not any(inventories[h].copies.get(r) for h in range(world) if h != r)]
    who = f"the state of rank(s) {lost} is held by no living process (a rank and every " \
          f"buddy holding its copy failed together)" if lost else \
          "no single iteration is held for every rank"
    raise NoCommittedStateError(f"cannot restore from memory: {who}; last committed "
                                f"iteration {last}")
