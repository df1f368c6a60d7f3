"""Megatron-core's model-parallel groups, the one place the package reads or builds them
(``megatron.core.parallel_state``): its first build and every replay, their destruction at
an abort, the role of each group (the global that holds it, so that every holder of a group
can be pointed at the next generation's group of the same role), and the data-parallel
size the mirror's shard layout needs.

    initialize(**kwargs) ─► roles() / group_of(role) ... ─► destroy() | forget()
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Dict

log = logging.getLogger(__name__)


def initialize(staged: bool = False, **kwargs) -> None:
    """``parallel_state.initialize_model_parallel(**kwargs)``; with ``staged``
    (``--deadpool-grad-stats staged``) its world-sized grad-stats group is a ``StagedGroup``
    (``staged_grad_stats``)."""
    from megatron.core import parallel_state as ps

    with staged_grad_stats() if staged else contextlib.nullcontext():
        ps.initialize_model_parallel(**kwargs)
    if staged:
        log.info("megatron-core's grad stats: %s", "staged (no group of every rank)"
                 if grad_stats_staged() else "on its group of every rank (the model-parallel "
                 "and data-parallel groups do not tile the world: staging needs both > 1)")


# megatron-core's group of every rank when the distributed optimizer has one instance: it
# only sums (or maxes) the grad norm, the zeros count and found-inf across the world
GRAD_STATS = "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"


class _Done:
    """A finished collective's work (the stages ran to completion, blocking)."""

    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        from torch.futures import Future

        fut = Future()
        fut.set_result(self._tensors)
        return fut


@functools.lru_cache(maxsize=None)
def _staged_type():
    import torch.distributed as dist

    class StagedGroup(dist.ProcessGroup):
        """Megatron's world-sized grad-stats group, served by groups every rank holds anyway:
        an all-reduce is one over the model-parallel group (TP x PP), then one over the
        data-parallel group with context parallel. The two tile the world (each rank's
        value counted once), so SUM and MAX are the world's; the sum's rounding order is
        the stages', the same in a failure-free run and after any recovery. No
        communicator of the world is ever made, so a recovery rebuilds none (issue 57).
        The stages are looked up at each call: after a rebuild they are the new ones."""

        group_name = None  # in no registry: nothing to tally, abort or destroy
        group_desc = GRAD_STATS

        def allreduce(self, tensors, opts=None):
            from megatron.core import parallel_state as ps

            op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
            for group in (ps.get_model_parallel_group(),
                          ps.get_data_parallel_group(with_context_parallel=True)):
                for t in tensors:
                    dist.all_reduce(t, op=op, group=group)
            return _Done(tensors)

        def getBackendName(self) -> str:
            return "staged"

    return StagedGroup


def is_staged(group) -> bool:
    return isinstance(group, _staged_type())


def grad_stats_staged() -> bool:
    """megatron's grad-stats group, as built now, is a ``StagedGroup``."""
    from megatron.core import parallel_state as ps

    return is_staged(ps.get_intra_distributed_optimizer_instance_group(
        check_initialized=False))


@contextlib.contextmanager
def staged_grad_stats():
    """Within the block, megatron's ``new_group`` call for the grad-stats group of every
    rank (``GRAD_STATS``, one optimizer instance) returns a ``StagedGroup``: torch is not
    called, on any rank (every rank skips the same call). Any other call, or a world whose
    model-parallel and data-parallel sizes do not tile it, goes to torch as asked."""
    import torch.distributed as dist

    original = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        if kwargs.get("group_desc") == GRAD_STATS:
            world = dist.get_world_size()
            every = ranks is None or (len(ranks) == world and
                                      sorted(ranks) == list(range(world)))
            if every and _tiles(world):
                return _staged_type()(dist.get_rank(), world)
        return original(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


def _tiles(world: int) -> bool:
    """The model-parallel and data-parallel (with context parallel) groups exist and their
    sizes multiply to the world."""
    from megatron.core import parallel_state as ps

    try:
        mp = ps.get_model_parallel_group().size()
        dp = ps.get_data_parallel_group(with_context_parallel=True).size()
    except (AssertionError, AttributeError, RuntimeError):
        return False
    return mp * dp == world and mp > 1 and dp > 1


def version() -> str:
    """megatron-core's version ("unknown" for a tree that does not say)."""
    try:
        from megatron.core import __version__
    except ImportError:
        return "unknown"
    return str(__version__)


def destroy() -> None:
    """Forget megatron's groups (its globals); a tree without megatron-core has none."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return
    ps.destroy_model_parallel()


def forget() -> None:
    """Forget megatron's groups (its globals) but destroy none of them: a recovery keeps
    the unbroken ones (recovery/repair.py), and destroys the others itself."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return
    import torch.distributed as dist

    destroy, dist.destroy_process_group = dist.destroy_process_group, _destroy_nothing
    try:
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group = destroy


def _destroy_nothing(group=None) -> None:
    """``destroy_process_group`` while megatron forgets its groups (``forget``)."""


def data_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def roles(group_type: type) -> Dict[int, str]:
    """id(group) -> role, for every group of type ``group_type`` megatron holds now: the
    name of the global that holds it (``_name[i]`` inside a list or tuple)."""
    from megatron.core import parallel_state as ps

    found: Dict[int, str] = {}
    for name in sorted(vars(ps)):
        val = getattr(ps, name)
        if isinstance(val, group_type):
            found.setdefault(id(val), name)
        elif isinstance(val, (list, tuple)):
            for i, v in enumerate(val):
                if isinstance(v, group_type):
                    found.setdefault(id(v), f"{name}[{i}]")
    return found


def group_of(role: str):
    """The group megatron holds now under ``role`` (as ``roles`` names it)."""
    from megatron.core import parallel_state as ps

    if role.endswith("]"):
        name, idx = role[:-1].split("[")
        return getattr(ps, name)[int(idx)]
    return getattr(ps, role)
