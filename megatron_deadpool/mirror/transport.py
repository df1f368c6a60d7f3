"""Mirror transport: one small interface for moving snapshot bytes between ranks.

Every implementation passes the same conformance test (tests/test_transport.py).

    exchange(sends=[(dst, buf)], recvs=[(src, buf)])   point-to-point, all at once, blocking
    all_ok(flag) -> bool                               True iff every member passed True
    all_gather_int(v) -> [v of rank 0, 1, ...]         (slot sizes)
    all_gather_json(obj) -> [obj of rank 0, 1, ...]    (restore inventories)

Buffers are uint8 CPU tensors; receive buffers are preallocated by the caller with the
sender's exact size.
"""

from __future__ import annotations

import abc
import json
from datetime import timedelta
from typing import List, Sequence, Tuple

import torch


class MirrorTransport(abc.ABC):
    rank: int
    world_size: int

    @abc.abstractmethod
    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]],
                 recvs: Sequence[Tuple[int, torch.Tensor]]) -> None:
        """Send each buffer to its destination and fill each receive buffer from its source."""

    @abc.abstractmethod
    def all_ok(self, ok: bool) -> bool:
        """Collective AND across all members (the commit barrier)."""

    @abc.abstractmethod
    def all_gather_int(self, value: int) -> List[int]:
        """Every member's int, in rank order."""

    @abc.abstractmethod
    def all_gather_json(self, obj) -> List:
        """Every member's JSON-serializable object, in rank order."""


class GlooTransport(MirrorTransport):
    """Default: a dedicated gloo group over CPU tensors, so mirror traffic never queues behind
    training collectives (and works next to NCCL)."""

    def __init__(self, timeout_s: float = 600.0, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def exchange(self, sends, recvs) -> None:
        dist = self._dist
        works = []
        for src, buf in recvs:
            works.append(dist.irecv(buf, src=src, group=self.group))
        for dst, buf in sends:
            works.append(dist.isend(buf, dst=dst, group=self.group))
        for w in works:
            w.wait()

    def all_ok(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def all_gather_int(self, value: int) -> List[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._dist.all_gather(out, torch.tensor([int(value)], dtype=torch.int64),
                              group=self.group)
        return [int(t.item()) for t in out]

    def all_gather_json(self, obj) -> List:
        out = [None] * self.world_size
        self._dist.all_gather_object(out, json.dumps(obj), group=self.group)
        return [json.loads(x) for x in out]


class StoreTransport(MirrorTransport):
    """Moves bytes through a c10d Store (TCPStore/FileStore). Slower; needs no process group,
    so it also works between processes that share only the coordinator. ``tag`` namespaces
    one use; every call advances a round counter that all members advance in lockstep."""

    def __init__(self, store, rank: int, world_size: int, tag: str = "mirror",
                 timeout_s: float = 600.0):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.tag, self.timeout_s = tag, timeout_s
        self._round = 0

    def _key(self, *parts) -> str:
        return "/".join([self.tag, str(self._round), *map(str, parts)])

    def _get(self, key: str) -> bytes:
        self.store.wait([key], timedelta(seconds=self.timeout_s))
        return self.store.get(key)

    def exchange(self, sends, recvs) -> None:
        for dst, buf in sends:
            self.store.set(self._key("p2p", self.rank, dst), buf.numpy().tobytes())
        for src, buf in recvs:
            data = self._get(self._key("p2p", src, self.rank))
            if len(data) != buf.numel():
                raise RuntimeError(f"store transport: expected {buf.numel()} bytes from rank "
                                   f"{src}, got {len(data)}")
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._barrier("x")
        self._round += 1

    def _gather(self, name: str, value: str) -> List[str]:
        self.store.set(self._key(name, self.rank), value)
        out = [self._get(self._key(name, r)).decode() for r in range(self.world_size)]
        return out

    def _barrier(self, name: str) -> None:
        self._gather("barrier-" + name, "1")

    def all_ok(self, ok: bool) -> bool:
        vals = self._gather("ok", "1" if ok else "0")
        self._round += 1
        return all(v == "1" for v in vals)

    def all_gather_int(self, value: int) -> List[int]:
        vals = self._gather("gather", str(int(value)))
        self._round += 1
        return [int(v) for v in vals]

    def all_gather_json(self, obj) -> List:
        vals = self._gather("json", json.dumps(obj))
        self._round += 1
        return [json.loads(v) for v in vals]
