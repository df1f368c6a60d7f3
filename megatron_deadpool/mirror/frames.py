"""The socket transport's messages after the handshake, each authenticated:

    [u64 length][payload][32-byte tag]     tag = HMAC-SHA256(K, seq | length | payload)

K is the connection's own key, derived by both ends in the handshake (``handshake.
frame_key``: the job secret over both nonces, the generation, both ranks and the purpose),
so it is fresh per connection and never crosses the wire. ``seq`` counts the messages of
one direction of one connection from 0: a recorded message replayed, reordered or spliced
into another connection fails its tag. The receiver checks the tag once the whole payload
is in and refuses the message (``PeerLost``, the connection is not used again) on a
mismatch, before anyone reads the slot (the snapshot's own checks come after).

The tag is computed on the thread that runs the exchange (the mirror's job thread, or a
handoff's thread), never the training thread. hashlib releases the GIL on large buffers.
Its CPU cost per GB is measured in docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import hmac
import selectors
import socket
import struct

import torch

from ..base.errors import MirrorError

LENGTH = struct.Struct("<Q")
HEAD = struct.Struct("<QQ")  # seq, length: what the tag binds besides the payload
TAG_BYTES = 32


class PeerLost(MirrorError):
    """A mirror connection closed or failed mid-exchange (a peer process is gone), or a
    message failed its tag."""


def tag(key: bytes, seq: int, payload: memoryview) -> bytes:
    h = hmac.new(key, HEAD.pack(seq, len(payload)), hashlib.sha256)
    h.update(payload)
    return h.digest()


class Send:
    event = selectors.EVENT_WRITE

    def __init__(self, sock: socket.socket, buf: torch.Tensor, key: bytes, seq: int):
        self.sock = sock
        payload = memoryview(buf.numpy()).cast("B")
        self.parts = [memoryview(LENGTH.pack(len(payload)))] + (
            [payload] if len(payload) else []) + [memoryview(tag(key, seq, payload))]

    def step(self) -> bool:
        """Write what the socket takes now; True when everything is written."""
        try:
            while self.parts:
                n = self.sock.sendmsg(self.parts)
                while n and self.parts:
                    k = min(n, len(self.parts[0]))
                    n -= k
                    self.parts[0] = self.parts[0][k:]
                    if not len(self.parts[0]):
                        self.parts.pop(0)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerLost(f"mirror send: {exc}") from exc
        return True


class Recv:
    event = selectors.EVENT_READ

    def __init__(self, sock: socket.socket, buf: torch.Tensor, src: int, key: bytes,
                 seq: int):
        self.sock, self.src, self.key, self.seq = sock, src, key, seq
        self.buf = memoryview(buf.numpy()).cast("B")
        self.head = bytearray(LENGTH.size)
        self.view = memoryview(self.head)  # the length, then the payload, then the tag
        self.stage, self.n, self.got_tag = 0, 0, bytearray(TAG_BYTES)

    def _next(self) -> bool:
        """The current part is complete: move to the next one; True once all are in."""
        if self.stage == 0:
            (self.n,) = LENGTH.unpack(self.head)
            if self.n > len(self.buf):
                raise PeerLost(f"mirror receive: {self.n} bytes from rank {self.src} do "
                               f"not fit the {len(self.buf)}-byte receive buffer")
            self.view, self.stage = self.buf[:self.n], 1
            return False
        if self.stage == 1:
            self.view, self.stage = memoryview(self.got_tag), 2
            return False
        if not hmac.compare_digest(bytes(self.got_tag),
                                   tag(self.key, self.seq, self.buf[:self.n])):
            raise PeerLost(f"mirror receive: the message from rank {self.src} failed its "
                           f"tag (altered, replayed or not this connection's)")
        return True

    def step(self) -> bool:
        """Read what has arrived; True when the whole message is in and its tag holds."""
        try:
            while True:
                if not len(self.view):
                    if self._next():
                        return True
                    continue
                got = self.sock.recv_into(self.view)
                if got == 0:
                    raise PeerLost(f"mirror receive: rank {self.src} closed the connection")
                self.view = self.view[got:]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerLost(f"mirror receive from rank {self.src}: {exc}") from exc
