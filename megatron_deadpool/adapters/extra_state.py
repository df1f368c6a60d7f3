"""Module extra state (``nn.Module.get_extra_state``) in the snapshot.

Transformer Engine keeps a module's FP8 scaling state (amax history, scales) outside its
parameters and buffers, as the module's extra state (``_extra_state`` in a state dict).
Neither the optimizer shard nor the module buffers hold it, so a promoted spare built its
modules with fresh scaling state and the run stopped being bitwise after a swap under
``--fp8-format``. Every module whose class overrides ``get_extra_state`` is asked for it
after each step, and it travels in the snapshot's metadata (values only: a tensor or the
bytes of a ``BytesIO``, never a pickle read back here); a restore hands each value back to
``set_extra_state``. Megatron's own local linear layers return None (nothing to carry).
"""

from __future__ import annotations

import io
from typing import Dict, List, Sequence, Tuple

import torch

from ..base.errors import DeadpoolError


Holders = List[Tuple[str, torch.nn.Module]]


def holders(model_chunks: Sequence[torch.nn.Module]) -> Holders:
    """The modules whose class overrides ``get_extra_state``, by name: found once, at
    attach (the model's modules do not change), not walked again every step."""
    base = torch.nn.Module.get_extra_state
    return [(f"chunk{ci}.{name}", m) for ci, chunk in enumerate(model_chunks)
            for name, m in chunk.named_modules()
            if getattr(type(m), "get_extra_state", base) is not base]


def capture(mods: Holders) -> Dict[str, object]:
    """{module name: its extra state}, as a CPU tensor (a copy) or bytes; modules whose
    extra state is None are left out. Another type is refused, not pickled."""
    out: Dict[str, object] = {}
    for name, m in mods:
        s = m.get_extra_state()
        if s is None:
            continue
        if isinstance(s, torch.Tensor):
            out[name] = s.detach().to("cpu", copy=True)
        elif isinstance(s, io.BytesIO):
            out[name] = s.getvalue()
        else:
            raise DeadpoolError(f"module {name} ({type(m).__name__}) has extra state of type "
                                f"{type(s).__name__}, which DeadPool cannot mirror")
    return out


def apply(mods: Holders, states: Dict[str, object]) -> None:
    """Give each module its captured extra state back (``set_extra_state``). A name with no
    such module is an error: the snapshot belongs to another model."""
    by_name = dict(mods)
    missing = sorted(set(states) - set(by_name))
    if missing:
        raise DeadpoolError(f"snapshot has extra state for unknown modules: {missing[:3]}")
    for name, s in states.items():
        by_name[name].set_extra_state(io.BytesIO(s) if isinstance(s, bytes) else s)
