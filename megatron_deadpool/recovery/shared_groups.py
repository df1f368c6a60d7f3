"""One gloo group per distinct member set while megatron builds its model-parallel groups.

Megatron creates a group per role, and many roles have the same members. On a gloo world,
``initialize_model_parallel`` at TP2·PP2·DP2 (megatron-core 0.16.1, 8 ranks) makes 77
``new_group`` calls; rank 0 is a member of 20 groups with 8 distinct member sets::

    (0,2)     x6   data parallel, with context parallel, their *_GLOO twins, ...
    (0,1)     x4   tensor parallel, ...           (0,)        x3
    (0,4)     x2   pipeline, embedding            (0,1,4,5)   x2
    (0,1,2,3) x2                                  (0..7)      x1

Each gloo group is a full mesh of TCP pairs, connected through the store when it is built,
and a recovery rebuilds all of them. Here a call whose group would be gloo, with default
options, gets the group an earlier call made for the same members and timeout. Sharing is
safe for gloo: a rank issues its ops on megatron's groups from its main thread in program
order, every member runs the same program, and a gloo group matches collectives by a
per-group sequence and point-to-point ops by tag, so two roles' ops on one group pair up as
they would on two. NCCL groups are never shared: megatron overlaps roles on separate
communicators and streams. The decision depends only on the call's arguments, which are
the same on every rank, so every rank skips the same calls and torch's group numbering
stays in step.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional, Tuple


def share_key(arguments: dict, world_backend: str, world_size: int) -> Optional[Tuple]:
    """The key under which a ``new_group`` call may share a group, or None (build its own).

    >>> share_key({"ranks": [2, 0]}, "gloo", 4)
    ((0, 2), None)
    >>> share_key({"ranks": [0, 1], "backend": "nccl"}, "gloo", 4) is None
    True
    >>> share_key({"ranks": [0, 1]}, "nccl", 4) is None
    True
    >>> share_key({"ranks": None, "backend": "gloo", "timeout": 5}, "nccl", 2)
    ((0, 1), 5)
    """
    backend = arguments.get("backend") or world_backend
    if str(backend).lower() != "gloo":
        return None
    if arguments.get("pg_options") is not None or arguments.get("device_id") is not None:
        return None
    if arguments.get("use_local_synchronization"):
        return None  # only members call: the others' numbering would not skip it
    ranks = arguments.get("ranks")
    members = tuple(sorted(ranks)) if ranks is not None else tuple(range(world_size))
    return members, arguments.get("timeout")


@contextlib.contextmanager
def shared_gloo_groups(world_backend: str, world_timeout=None):
    """Within the block, ``torch.distributed.new_group`` returns an earlier group for a call
    with the same ``share_key``. Yields the number of calls that shared (a list of one).

    ``world_timeout``: the timeout the calls pass (megatron's ``distributed_timeout_minutes``)
    when it is the default group's own. A call for every rank then gets the default group:
    megatron's intra-distributed-optimizer-instance group has every rank when there is one
    instance, and would be a second full mesh of the world (W - 1 connections per rank at
    every recovery). Not a call that names its backend: those are megatron's ``*_GLOO``
    groups, which ``destroy_model_parallel`` destroys itself, and destroying the default
    group would end the whole world (with TP = PP = 1 the data-parallel group has every
    rank)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = dist.new_group
    # torch's own signature: ``original`` may be a wrapper taking (*args, **kwargs)
    signature = inspect.signature(distributed_c10d.new_group)
    made: dict = {}
    world_key = None  # the default group's key, when it may be shared
    if world_timeout is not None and str(world_backend).lower() == "gloo":
        world_key = (tuple(range(dist.get_world_size())), world_timeout)
        made[world_key] = dist.group.WORLD
    shared = [0]

    def new_group(*args, **kwargs):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # not torch's signature: build as asked
            arguments = {"backend": "unknown"}
        key = share_key(arguments, world_backend, dist.get_world_size())
        if key is not None and key == world_key and arguments.get("backend") is not None:
            key = ("named backend",) + key  # never the default group: see above
        if key is not None and key in made:
            shared[0] += 1
            return made[key]
        group = original(*args, **kwargs)
        if key is not None:
            made[key] = group
        return group

    dist.new_group = new_group
    try:
        yield shared
    finally:
        dist.new_group = original
