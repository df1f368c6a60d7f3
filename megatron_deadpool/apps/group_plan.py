"""What a node's loss breaks among megatron-core's own groups, for any layout, with no job
(issue 57): megatron-core's ``initialize_model_parallel`` runs once on torch's ``fake``
backend (no communication), every ``new_group`` call's members are recorded, and the groups
that hold a rank of the lost node are the ones a recovery rebuilds (recovery/repair.py keeps
every other group of a survivor). ``deadpool sim`` reads these plans (apps/sim_scale.py);
``scripts/megatron_group_plan.py`` prints one.

    python -m megatron_deadpool.apps.group_plan --world 99968 --tp 8 --pp 16
                        [--gpus-per-node 4] [--lost-node 0] [--grad-stats world|staged]

One JSON line: distinct_groups, members_total, groups_with_a_dead_rank (with the sum of
their sizes, what the store serves to rebuild them), and the busiest survivor (most
connections to rebuild: size - 1 per rebuilt group) with its rebuilt groups' sizes and
megatron's names for them. At W = 100,000 it takes about 1.5 minutes and 2 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Dict, List, Tuple

from ..base.config import GradStats, values


def check_layout(world: int, tp: int, pp: int, gpus_per_node: int) -> None:
    from ..base.errors import ConfigError

    if min(world, tp, pp, gpus_per_node) < 1:
        raise ConfigError("world, TP, PP and GPUs per node must be >= 1")
    if world % (tp * pp) or world % gpus_per_node:
        raise ConfigError(f"world {world} must be a multiple of TP x PP ({tp * pp}) and of "
                          f"the GPUs per node ({gpus_per_node})")


GRAD_STATS = values(GradStats)  # --deadpool-grad-stats' values


def _record(world: int, tp: int, pp: int, grad_stats: str
            ) -> Tuple[List[Tuple[Tuple[int, ...], str]], str]:
    """Every ``new_group`` megatron-core's initialize_model_parallel calls, through the
    package's own build (adapters/groups.py) with ``--deadpool-grad-stats grad_stats``:
    (members, desc); and how the grad stats of every rank were reduced ("staged": no group
    of the world is made)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..adapters import groups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    calls, torch_new_group = [], dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        members = tuple(ranks) if ranks is not None else tuple(range(world))
        calls.append((members, kwargs.get("group_desc")))
        if 0 in members:  # rank 0's own groups exist (megatron reads them back)
            return torch_new_group(ranks, *args, **kwargs)
        return dist.GroupMember.NON_GROUP_MEMBER

    dist.new_group = new_group
    try:
        groups.initialize(grad_stats == "staged", tensor_model_parallel_size=tp,
                          pipeline_model_parallel_size=pp,
                          create_gloo_process_groups=False)
    finally:
        dist.new_group = torch_new_group
    staged = groups.grad_stats_staged()
    return calls, (GradStats.STAGED if staged else GradStats.WORLD).value


def plan(world: int, tp: int, pp: int, gpus_per_node: int = 4, lost_node: int = 0,
         grad_stats: str = "world") -> Dict:
    """The plan of one layout (run in a process of its own: it initializes torch.distributed
    on the fake backend). ``grad_stats``: --deadpool-grad-stats' value."""
    check_layout(world, tp, pp, gpus_per_node)
    t0 = time.monotonic()
    calls, grad_stats = _record(world, tp, pp, grad_stats)
    names: Dict[Tuple[int, ...], str] = {}
    for members, desc in calls:
        names.setdefault(tuple(sorted(members)), desc)
    dead = set(range(lost_node * gpus_per_node, (lost_node + 1) * gpus_per_node))
    rebuilt = [g for g in names if dead & set(g)]
    load: Counter = Counter()
    for g in rebuilt:
        for r in g:
            if r not in dead:
                load[r] += len(g) - 1
    rank, connections = max(load.items(), key=lambda kv: (kv[1], -kv[0]))
    mine = [g for g in rebuilt if rank in g]
    from ..adapters import groups

    megatron_core = groups.version()
    return {"world": world, "tp": tp, "pp": pp, "dp": world // (tp * pp),
            "gpus_per_node": gpus_per_node, "lost_node_ranks": sorted(dead),
            "megatron_core": megatron_core, "grad_stats": grad_stats,
            "new_group_calls_per_rank": len(calls), "distinct_groups": len(names),
            "members_total": sum(len(g) for g in names),
            "groups_with_a_dead_rank": len(rebuilt),
            "rebuilt_members_total": sum(len(g) for g in rebuilt),
            "survivors_that_rebuild": len(load),
            "busiest_survivor": {
                "rank": rank, "groups_rebuilt": len(mine), "gloo_connections": connections,
                "groups": sorted(({"size": len(g), "megatron": names[g]} for g in mine),
                                 key=lambda x: x["size"])},
            "enumerate_s": round(time.monotonic() - t0, 1)}


def key(world: int, tp: int, pp: int, gpus_per_node: int, grad_stats: str = "world") -> str:
    staged = "" if grad_stats == GradStats.WORLD.value else f".{grad_stats}"
    return f"W{world}.TP{tp}.PP{pp}.G{gpus_per_node}{staged}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--lost-node", type=int, default=0)
    ap.add_argument("--grad-stats", choices=GRAD_STATS, default=GRAD_STATS[0],
                    help="--deadpool-grad-stats of the job (default %(default)s)")
    a = ap.parse_args(argv)
    from ..base.errors import ConfigError

    try:
        check_layout(a.world, a.tp, a.pp, a.gpus_per_node)
    except ConfigError as exc:
        ap.error(str(exc))
    print(json.dumps(plan(a.world, a.tp, a.pp, a.gpus_per_node, a.lost_node, a.grad_stats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
