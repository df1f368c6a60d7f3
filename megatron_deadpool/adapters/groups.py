"""Megatron-core's model-parallel groups, the one place the package reads or builds them
(``megatron.core.parallel_state``): its first build and every replay, their destruction at
an abort, the role of each group (the global that holds it, so that every holder of a group
can be pointed at the next generation's group of the same role), and the data-parallel
size the mirror's shard layout needs.

    initialize(**kwargs) ─► roles() / group_of(role) ... ─► destroy() | forget()
"""

from __future__ import annotations

from typing import Dict


def initialize(**kwargs) -> None:
    """``parallel_state.initialize_model_parallel(**kwargs)``."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(**kwargs)


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
