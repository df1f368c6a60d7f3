"""Re-home the mirrored tensors into flat buffers laid out like the snapshot slot, so that a
snapshot is one copy per buffer instead of one per tensor.

    before:  exp_avg(p0) exp_avg_sq(p0) ... 140 separate allocations -> 140 copies
    after:   [ p0.exp_avg | p1.exp_avg | ... | p0.exp_avg_sq | ... | p0.step | ... ]
             one buffer, in slot order (adapters/shard.py: grouped by key) -> 1 copy

A tensor is re-homed in place (``Tensor.set_``), so every holder of the tensor object (the
optimizer's ``state``, its ``param_groups``, megatron's shard lists) sees the new storage
with the same values. Only tensors that own their storage alone are moved: a view into
another buffer (megatron's grad/param buffers, the fp32 main param of an fp32 model) or a
storage that another tensor object also references (``p.data`` of a model param) stays
where it is and simply ends a flat run.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

# A flat buffer is allocated whole before the tensors it replaces are freed: the cap bounds
# that transient extra memory (device memory on GPU), at the price of one copy per buffer.
MAX_BUFFER_BYTES = 1 << 30


def exclusive(t: torch.Tensor) -> bool:
    """True if ``t`` is the only tensor on its storage and covers all of it."""
    if not t.is_contiguous() or t.storage_offset() != 0 or t.numel() == 0:
        return False
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size():
        return False
    # one reference from t's TensorImpl, one from the ``storage`` handle just taken
    return torch._C._storage_Use_Count(storage._cdata) == 2


def runs(tensors: Sequence[torch.Tensor], cap: int = MAX_BUFFER_BYTES) -> List[List[int]]:
    """Indexes of consecutive movable tensors that can share one buffer: same device, each
    starting at a byte offset that its element size divides (packed, as in the slot), at
    most ``cap`` bytes in all (a larger tensor stays alone)."""
    out: List[List[int]] = []
    cur: List[int] = []
    nbytes, device = 0, None
    for i, t in enumerate(tensors):
        if not exclusive(t):
            cur = []
            continue
        size, n = t.element_size(), t.numel() * t.element_size()
        if not cur or t.device != device or nbytes % size or nbytes + n > cap:
            cur, nbytes, device = [], 0, t.device
            out.append(cur)
        cur.append(i)
        nbytes += n
    return [r for r in out if len(r) > 1]


def consolidate(tensors: Sequence[torch.Tensor], cap: int = MAX_BUFFER_BYTES) -> int:
    """Move runs of ``tensors`` (in slot order) into fresh flat buffers, values unchanged.
    Returns how many tensors moved. Safe to call again: moved tensors share a buffer and are
    no longer ``exclusive``."""
    moved = 0
    for run in runs(tensors, cap):
        members = [tensors[i] for i in run]
        total = sum(t.numel() * t.element_size() for t in members)
        flat = torch.empty(total, dtype=torch.uint8, device=members[0].device)
        storage, off = flat.untyped_storage(), 0
        with torch.no_grad():
            for t in members:
                n = t.numel() * t.element_size()
                flat[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
                t.set_(storage, off // t.element_size(), t.shape, t.stride())
                off += n
        moved += len(members)
    return moved
