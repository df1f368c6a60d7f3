"""The gloo mirror transport (``--deadpool-mirror-transport gloo``): the exchange on a
world-wide gloo group of its own, which the registry's ``gloo`` entry (transport.py) builds
through the runtime's ``communicator`` (control/link.py: the abort shuts it down).

Authenticated as the socket transport's messages are (issue 49): each message is followed,
on a tag channel of its own, by ``[u64 length][32-byte tag]``, the tag HMAC-SHA256 under the
pair's key over (seq, length, payload) (``frames.tag``). The pair's key is derived from the
job secret, the generation and both ranks (``handshake.proof``, its own label), so it never
crosses the wire; ``seq`` counts one direction's messages of one generation. A message that
another job, generation, pair or position wrote, or anyone who reaches gloo's connections
through torch's rendezvous keys, fails its tag: the receiver raises PeerLost before anyone
reads the slot. Gloo's connections are set up by torch's rendezvous, so there is no handshake
of this transport's own; the runtime hands it the signed store rounds (``rounds``) for its
collectives, as the socket transport's. Without ``rounds`` (tests, benchmarks) the
collectives run on the gloo group, unauthenticated."""

from __future__ import annotations

import hmac
import json
import struct
from datetime import timedelta
from typing import Dict, List, Optional

import torch

from ..base.errors import TransportTimeout
from . import frames, handshake
from .transport_api import MirrorTransport, count_collective, count_messages

TAG_CHANNEL = 1  # the gloo tag of the tag messages (the payloads go on 0)
TRAILER = struct.Struct(f"<Q{frames.TAG_BYTES}s")  # the payload's length, its tag


class GlooTransport(MirrorTransport):
    """A dedicated gloo group over CPU tensors, so mirror traffic never queues behind
    training collectives (and works next to NCCL). It runs the mirror's collectives, and
    its exchange with ``--deadpool-mirror-transport gloo`` (socket_transport.py: the
    default exchange)."""

    kind = "gloo"

    def __init__(self, timeout_s: float = 600.0, group=None,
                 create_timeout_s: Optional[float] = None, secret: Optional[str] = None,
                 gen: int = 0, rounds=None):
        """``timeout_s``: each operation's deadline (config.gloo_op_timeout_s: gloo leaves a
        send queued on a failed connection waiting until it); ``create_timeout_s``: the
        group's creation, which waits for every member (a promoted spare builds its model
        first), default ``timeout_s``; ``secret``, ``gen``: the job's and the generation's,
        which key the tags (None: an empty key, for tests); ``rounds``: the signed store
        rounds the collectives go to (None: the group's own)."""
        self.rounds = rounds
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
        self.tags = Tags(secret or "", gen, self.rank)

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
        dist, tags = self._dist, self.tags
        count_messages(sends, recvs)
        trailers_in = [(src, buf, torch.zeros(TRAILER.size, dtype=torch.uint8),
                        tags.next_in(src)) for src, buf in recvs]
        trailers_out = [torch.frombuffer(bytearray(tags.trailer(dst, buf)), dtype=torch.uint8)
                        for dst, buf in sends]
        works = [dist.irecv(buf, src=src, group=self.group) for src, buf in recvs]
        works += [dist.irecv(t, src=src, group=self.group, tag=TAG_CHANNEL)
                  for src, _, t, _ in trailers_in]
        works += [dist.isend(buf, dst=dst, group=self.group) for dst, buf in sends]
        works += [dist.isend(t, dst=dst, group=self.group, tag=TAG_CHANNEL)
                  for (dst, _), t in zip(sends, trailers_out)]
        self._wait(works, timeout_s, "exchange")
        for src, buf, trailer, seq in trailers_in:
            tags.check(src, buf, bytes(trailer.numpy()), seq)

    def all_ok(self, ok: bool, timeout_s=None) -> bool:
        if self.rounds is not None:
            return self.rounds.all_ok(ok, timeout_s)
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        count_collective(8)
        self._wait([self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group,
                                          async_op=True)], timeout_s, "commit")
        return bool(t.item())

    def all_gather_int(self, value: int, timeout_s=None) -> List[int]:
        if self.rounds is not None:
            return self.rounds.all_gather_int(value, timeout_s)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        count_collective(8 * self.world_size)  # what arrives: one value per rank
        self._wait([self._dist.all_gather(out, torch.tensor([int(value)], dtype=torch.int64),
                                          group=self.group, async_op=True)],
                   timeout_s, "all_gather")
        return [int(t.item()) for t in out]

    def gather_from(self, value, ranks, timeout_s=None):
        if self.rounds is not None:
            return self.rounds.gather_from(value, ranks, timeout_s)
        return super().gather_from(value, ranks, timeout_s)

    def all_gather_json(self, obj, timeout_s=None) -> List:
        if self.rounds is not None:
            return self.rounds.all_gather_json(obj, timeout_s)
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


class Tags:
    """One rank's message tags in one generation: the pairs' keys and each direction's
    sequence numbers."""

    def __init__(self, secret: str, gen: int, rank: int):
        self.secret, self.gen, self.rank = secret, gen, rank
        self._keys: Dict[tuple, bytes] = {}
        self._seq: Dict[tuple, int] = {}  # ("out", dst) / ("in", src) -> messages so far

    def _key(self, sender: int, receiver: int) -> bytes:
        if (sender, receiver) not in self._keys:
            self._keys[(sender, receiver)] = handshake.proof(
                self.secret, "deadpool-gloo-frame-key", b"", b"", self.gen, sender, receiver)
        return self._keys[(sender, receiver)]

    def _next(self, way: str, peer: int) -> int:
        seq = self._seq.get((way, peer), 0)
        self._seq[(way, peer)] = seq + 1
        return seq

    def trailer(self, dst: int, buf: torch.Tensor) -> bytes:
        """What follows the next message to ``dst``: its length and tag."""
        payload = memoryview(buf.numpy()).cast("B")
        tag = frames.tag(self._key(self.rank, dst), self._next("out", dst), payload)
        return TRAILER.pack(len(payload), tag)

    def next_in(self, src: int) -> int:
        """The sequence number of the next message from ``src``."""
        return self._next("in", src)

    def check(self, src: int, buf: torch.Tensor, trailer: bytes, seq: int) -> None:
        """The message ``seq`` from ``src``, in ``buf``, is the one its tag names: PeerLost
        if not."""
        n, got = TRAILER.unpack(trailer)
        payload = memoryview(buf.numpy()).cast("B")
        if n > len(payload) or not hmac.compare_digest(
                got, frames.tag(self._key(src, self.rank), seq, payload[:n])):
            raise frames.PeerLost(f"mirror receive: the message from rank {src} failed its "
                                  "tag (altered, replayed, or not this job's, generation's "
                                  "or pair's)")
