#!/usr/bin/env python3
"""What a node's loss breaks among megatron-core's own groups, for any layout, with no job:
megatron-core's ``initialize_model_parallel`` runs once on torch's ``fake`` backend (no
communication), every ``new_group`` call's members are recorded, and the groups that hold a
rank of the lost node are the ones a recovery rebuilds (recovery/repair.py keeps every other
group of a survivor). Prints one JSON line:

    python scripts/megatron_group_plan.py --world 99968 --tp 8 --pp 16 [--gpus-per-node 4]
                                          [--lost-node 0]

distinct_groups, members_total, groups_with_a_dead_rank, and the busiest survivor (most
gloo connections to rebuild: size - 1 per rebuilt group) with its rebuilt groups' sizes and
megatron's names for them. At W = 99,968 it takes about 1.5 minutes and 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plan(world: int, tp: int, pp: int, gpus_per_node: int, lost_node: int = 0) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_deadpool.adapters import groups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    calls, torch_new_group = [], dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        members = tuple(ranks) if ranks is not None else tuple(range(world))
        calls.append((members, kwargs.get("group_desc")))
        if 0 in members:  # rank 0's own groups exist (megatron reads them back)
            return torch_new_group(ranks, *args, **kwargs)
        return dist.GroupMember.NON_GROUP_MEMBER

    dist.new_group = new_group
    t0 = time.monotonic()
    try:
        groups.initialize(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          create_gloo_process_groups=False)
    finally:
        dist.new_group = torch_new_group
    names = {}
    for members, desc in calls:
        names.setdefault(tuple(sorted(members)), desc)
    dead = set(range(lost_node * gpus_per_node, (lost_node + 1) * gpus_per_node))
    rebuilt = [g for g in names if dead & set(g)]
    per = defaultdict(list)
    for g in rebuilt:
        for r in g:
            if r not in dead:
                per[r].append(g)
    rank, mine = max(per.items(), key=lambda kv: sum(len(g) - 1 for g in kv[1]))
    return {"world": world, "tp": tp, "pp": pp, "dp": world // (tp * pp),
            "gpus_per_node": gpus_per_node, "lost_node_ranks": sorted(dead),
            "new_group_calls_per_rank": len(calls), "distinct_groups": len(names),
            "members_total": sum(len(g) for g in names),
            "groups_with_a_dead_rank": len(rebuilt), "survivors_that_rebuild": len(per),
            "busiest_survivor": {
                "rank": rank, "groups_rebuilt": len(mine),
                "gloo_connections": sum(len(g) - 1 for g in mine),
                "groups": sorted(({"size": len(g), "megatron": names[g]} for g in mine),
                                 key=lambda x: x["size"])},
            "enumerate_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--lost-node", type=int, default=0)
    a = ap.parse_args()
    if a.world % (a.tp * a.pp) or a.world % a.gpus_per_node:
        ap.error(f"--world {a.world} must be a multiple of TP x PP ({a.tp * a.pp}) and of "
                 f"--gpus-per-node ({a.gpus_per_node})")
    print(json.dumps(plan(a.world, a.tp, a.pp, a.gpus_per_node, a.lost_node)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
