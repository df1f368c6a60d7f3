"""Snapshot buffers: one flat, preallocated host buffer per slot holding a header, every
tensor a rank needs to resume, and a small metadata blob (RNG, iteration, scheduler...).

Slot format (little endian)::

    +------------- header: 9 x int64, padded to 128 bytes ------+------------+-----------+
    | magic | owner rank | iteration | tensor bytes | meta bytes |  tensors   | meta blob |
    | crc   | layout id  | tensor end| job id                    | (packed)   | (values)  |
    +------------------------------------------------------------+------------+-----------+

The checksum (CRC-32C over per-chunk CRC-32Cs, see ``_crc``) covers tensors and metadata; it
is verified before anything is restored, and a copy of another job (job id: a hash of the job
secret), owner, iteration or layout (layout id: a hash of every tensor's name, shape and
dtype) is refused the same way. Format 3 (magic ``DPOOLMI3``): CRC-32C (the ``crc32c``
package: the SSE4.2 / ARMv8 CRC instruction, 20+ GB/s on one core here, GIL released), and
metadata in a format that carries values only (``metadata.py``: reading a copy never runs
code). Format 2 (``DPOOLMI2``: the same, with pickled metadata) and format 1 (``DPOOLMIR``,
zlib CRC-32 at ~3 GB/s) are recognised and refused by name.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch
from crc32c import crc32c

from ..base.errors import MirrorCorruptError
from . import metadata
from .threads import lower_thread_priority

MAGIC = 0x44504F4F4C4D4933  # "DPOOLMI3": format 3, CRC-32C, metadata.py's metadata
MAGIC_V2 = 0x44504F4F4C4D4932  # "DPOOLMI2": format 2, pickled metadata (refused)
MAGIC_V1 = 0x44504F4F4C4D4952  # "DPOOLMIR": format 1, zlib CRC-32 (refused)
HEADER_WORDS = 9
ALIGN = 64
HEADER_BYTES = 128  # HEADER_WORDS x 8, padded so the tensor area starts ALIGN-aligned


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int
    nbytes: int


class Layout:
    """Where each tensor lives inside a slot. Built once from the live tensors."""

    def __init__(self, named: Sequence[Tuple[str, torch.Tensor]], meta_capacity: int):
        self.entries: List[Entry] = []
        off, prev = HEADER_BYTES, None
        for name, t in named:  # packed back to back, but for the gaps of _storage_gap
            nbytes = t.numel() * t.element_size()
            off += _storage_gap(prev, t)
            self.entries.append(Entry(name, off, nbytes))
            off += nbytes
            prev = t
        self.tensor_end = _align(off)
        self.tensor_bytes = sum(e.nbytes for e in self.entries)  # read at every seal
        self.meta_capacity = meta_capacity
        self.total_bytes = _align(off + meta_capacity)
        h = hashlib.sha256()
        for e, (_, t) in zip(self.entries, named):
            h.update(f"{e.name}:{e.offset}:{e.nbytes}:{tuple(t.shape)}:{t.dtype};".encode())
        self.layout_id = int.from_bytes(h.digest()[:7], "little")


MAX_GAP = 4096  # bytes of padding between two views that the slot repeats


def _storage_gap(prev, t) -> int:
    """Bytes between ``prev``'s end and ``t``'s start when both are contiguous views into
    one storage, ``t`` shortly after ``prev`` (megatron's param buffer pads each param's
    start to 64 elements, so the shard pieces of an fp32 model's main params lie a little
    apart): the slot keeps the same gap, so the pieces stay one copy (``d2h.plan``). The
    gap depends only on offsets inside the storage, never on addresses, so every process
    of the same model computes the same layout. 0 otherwise."""
    if prev is None or not (prev.is_contiguous() and t.is_contiguous()):
        return 0
    if prev.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return 0
    gap = t.data_ptr() - (prev.data_ptr() + prev.numel() * prev.element_size())
    return gap if 0 < gap <= MAX_GAP else 0


def alloc_slot(nbytes: int, pin: bool) -> torch.Tensor:
    """A host buffer; pinned when CUDA is present (a CPU-only torch has no pinned allocator)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    buf.zero_()  # touch the pages now, not during the first snapshot
    return buf


def job_id(secret: str) -> int:
    """The job identity a slot carries: 7 bytes of a hash of the job secret (never the secret
    itself), so a copy written by another job is refused even at the same rank and iteration."""
    return int.from_bytes(hashlib.sha256(b"deadpool-mirror:" + secret.encode()).digest()[:7],
                          "little")


def _flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def copy_tensors_in(slot: torch.Tensor, layout: Layout, tensors: Sequence[torch.Tensor],
                    non_blocking: bool = False) -> None:
    """Copy live tensors into the slot (on the current CUDA stream when they are on GPU)."""
    if len(tensors) != len(layout.entries):
        raise MirrorCorruptError(f"snapshot expects {len(layout.entries)} tensors, "
                                 f"got {len(tensors)}")
    for e, t in zip(layout.entries, tensors):
        slot[e.offset:e.offset + e.nbytes].copy_(_flat_u8(t), non_blocking=non_blocking)


def _header(slot: torch.Tensor) -> torch.Tensor:
    return slot[:HEADER_WORDS * 8].view(torch.int64)


# The checksum: CRC-32C over the tensor area's per-chunk CRC-32Cs (little-endian u32 each),
# continued over the metadata. Chunks of a large slot are checksummed on a small thread
# pool (crc32c releases the GIL); a slot of one chunk (the CPU reference: 0.4 MB) is done
# inline. The value does not depend on the thread count.
CRC_CHUNK = 64 << 20
CRC_THREADS = min(8, max(1, (os.cpu_count() or 2) // 2))
_pool: "ThreadPoolExecutor | None" = None
_pool_lock = threading.Lock()


def _pool_init() -> None:
    lower_thread_priority(threading.get_native_id())


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="deadpool-crc",
                                       initializer=_pool_init)
        return _pool


def _chunk_crcs(mv: memoryview) -> bytes:
    pieces = [mv[i:i + CRC_CHUNK] for i in range(0, len(mv), CRC_CHUNK)]
    if len(pieces) > 1 and CRC_THREADS > 1:
        crcs = list(_executor().map(crc32c, pieces))
    else:
        crcs = [crc32c(p) for p in pieces]
    return struct.pack(f"<{len(crcs)}I", *crcs)


def checksum(buf: torch.Tensor) -> int:
    """The tensor area's checksum, for a whole uint8 host buffer (measurements)."""
    return crc32c(_chunk_crcs(memoryview(buf.numpy())))


def _crc(slot: torch.Tensor, tensor_end: int, meta_len: int) -> int:
    mv = memoryview(slot.numpy())
    crc = crc32c(_chunk_crcs(mv[HEADER_BYTES:tensor_end]))
    return crc32c(mv[tensor_end:tensor_end + meta_len], crc)


def seal(slot: torch.Tensor, layout: Layout, owner: int, iteration: int, meta: dict,
         job: int = 0) -> None:
    """Write the metadata blob, checksum and header (host side, after the tensor copy)."""
    blob = metadata.encode(meta)
    if len(blob) > layout.meta_capacity:
        raise MirrorCorruptError(f"snapshot metadata is {len(blob)} bytes, capacity "
                                 f"{layout.meta_capacity}")
    arr = slot.numpy()
    arr[layout.tensor_end:layout.tensor_end + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    struct.pack_into("<9q", arr, 0, MAGIC, owner, iteration, layout.tensor_bytes, len(blob),
                     _crc(slot, layout.tensor_end, len(blob)), layout.layout_id,
                     layout.tensor_end, job)


def sealed(slot: torch.Tensor) -> torch.Tensor:
    """The part of a sealed slot that carries anything (header, tensors, metadata), as a
    view: what goes to a buddy. The metadata capacity left unused (the CPU reference: 40 of
    the slot's 405 KB) is not sent. A slot whose header lies outside it is sent whole (the
    receiver's verify refuses it)."""
    if slot.numel() < HEADER_BYTES:
        return slot
    h = read_header(slot)
    used = h["tensor_end"] + h["meta_len"]
    return slot[:used] if HEADER_BYTES <= used <= slot.numel() else slot


def restamp_job(slot: torch.Tensor, job: int) -> None:
    """Adopt a verified slot into this job (a resume from files of an earlier job). The job
    id is not under the checksum."""
    _header(slot)[8] = job


def read_header(slot: torch.Tensor) -> dict:
    h = _header(slot).tolist()
    return {"magic": h[0], "owner": h[1], "iteration": h[2], "tensor_bytes": h[3],
            "meta_len": h[4], "crc": h[5], "layout_id": h[6], "tensor_end": h[7], "job": h[8]}


def verify(slot: torch.Tensor, owner: int, iteration: int, layout: "Layout | None" = None,
           job: int = 0, load_meta: bool = True, checksum: bool = True) -> "dict | None":
    """Check magic, job, owner, iteration, checksum (``checksum`` False: the header only)
    and (when given) the layout. Returns the metadata (``load_meta`` False: None; a holder
    does not need it). A holder verifies without a layout; the owner also checks its
    layout. Nothing is copied out of the slot here: a refused copy never reaches the live
    tensors."""
    h = read_header(slot)
    where = f"mirror copy of rank {owner} iteration {iteration}"
    if h["magic"] == MAGIC_V1:
        raise MirrorCorruptError(f"{where}: snapshot format 1 (zlib CRC-32) of an older "
                                 f"DeadPool; this version reads format 3 only")
    if h["magic"] == MAGIC_V2:
        raise MirrorCorruptError(f"{where}: snapshot format 2 (pickled metadata) of an older "
                                 f"DeadPool; this version reads format 3 only")
    if h["magic"] != MAGIC:
        raise MirrorCorruptError(f"{where}: bad magic (never written or overwritten)")
    if h["job"] != job:
        raise MirrorCorruptError(f"{where}: written by another job (job id {h['job']:#x}, "
                                 f"this job {job:#x})")
    if h["owner"] != owner or h["iteration"] != iteration:
        raise MirrorCorruptError(f"{where}: holds rank {h['owner']} iteration {h['iteration']}")
    if layout is not None and (h["layout_id"] != layout.layout_id
                               or h["tensor_bytes"] != layout.tensor_bytes
                               or h["tensor_end"] != layout.tensor_end):
        raise MirrorCorruptError(f"{where}: layout mismatch (the model or optimizer differs)")
    if not (HEADER_BYTES <= h["tensor_end"] <= slot.numel()
            and 0 <= h["meta_len"] <= slot.numel() - h["tensor_end"]):
        raise MirrorCorruptError(f"{where}: corrupt header")
    if not checksum:
        return None
    crc = _crc(slot, h["tensor_end"], h["meta_len"])
    if crc != h["crc"]:
        raise MirrorCorruptError(f"{where}: checksum mismatch (stored {h['crc']:#010x}, "
                                 f"computed {crc:#010x}); refusing to load it")
    if not load_meta:
        return None
    blob = slot[h["tensor_end"]:h["tensor_end"] + h["meta_len"]].numpy().tobytes()
    return metadata.decode(blob)


def copy_tensors_out(slot: torch.Tensor, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
    """Restore live tensors from a verified slot."""
    for e, t in zip(layout.entries, tensors):
        src = slot[e.offset:e.offset + e.nbytes]
        dst = _flat_u8(t)
        if dst.data_ptr() != t.data_ptr() or not t.is_contiguous():
            raise MirrorCorruptError(f"cannot restore non-contiguous tensor {e.name}")
        dst.copy_(src)
