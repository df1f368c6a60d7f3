"""The gloo mirror transport (``--deadpool-mirror-transport gloo``): exchange and collectives
on a world-wide gloo group of its own, which the registry's ``gloo`` entry (transport.py) takes
as the generation's collectives."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import List, Optional

import torch

from ..base.errors import TransportTimeout
from .transport_api import MirrorTransport, count_collective, count_messages


class GlooTransport(MirrorTransport):
    """A dedicated gloo group over CPU tensors, so mirror traffic never queues behind
    training collectives (and works next to NCCL). It runs the mirror's collectives, and
    its exchange with ``--deadpool-mirror-transport gloo`` (socket_transport.py: the
    default exchange)."""

    kind = "gloo"

    def __init__(self, timeout_s: float = 600.0, group=None,
                 create_timeout_s: Optional[float] = None):
        """``timeout_s``: each operation's deadline (config.gloo_op_timeout_s: gloo leaves a
        send queued on a failed connection waiting until it); ``create_timeout_s``: the
        group's creation, which waits for every member (a promoted spare builds its model
        first), default ``timeout_s``."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self._dist = dist
        self.timeout_s = timeout_s
        if group is None:
            group = dist.new_group(backend="gloo",
                                   timeout=timedelta(seconds=create_timeout_s or timeout_s))
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _wait(self, works, timeout_s: Optional[float], what: str) -> None:
        limit = timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        for w in works:
            try:
                w.wait(limit)
            except RuntimeError as exc:
                if "Timed out" in str(exc) or "timed out" in str(exc):
                    raise TransportTimeout(f"mirror {what}: no answer in "
                                           f"{limit.total_seconds():g}s") from exc
                raise

    def exchange(self, sends, recvs, timeout_s=None) -> None:
        dist = self._dist
        count_messages(sends, recvs)
        works = [dist.irecv(buf, src=src, group=self.group) for src, buf in recvs]
        works += [dist.isend(buf, dst=dst, group=self.group) for dst, buf in sends]
        self._wait(works, timeout_s, "exchange")

    def all_ok(self, ok: bool, timeout_s=None) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        count_collective(8)
        self._wait([self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group,
                                          async_op=True)], timeout_s, "commit")
        return bool(t.item())

    def all_gather_int(self, value: int, timeout_s=None) -> List[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        count_collective(8 * self.world_size)  # what arrives: one value per rank
        self._wait([self._dist.all_gather(out, torch.tensor([int(value)], dtype=torch.int64),
                                          group=self.group, async_op=True)],
                   timeout_s, "all_gather")
        return [int(t.item()) for t in out]

    def all_gather_json(self, obj, timeout_s=None) -> List:
        data = json.dumps(obj).encode()
        sizes = self.all_gather_int(len(data), timeout_s)
        n = max(sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        count_collective(n * self.world_size)
        self._wait([self._dist.all_gather(out, mine, group=self.group, async_op=True)],
                   timeout_s, "all_gather")
        return [json.loads(bytes(t[:k].tolist())) for t, k in zip(out, sizes)]
