"""The mirror listener's handshake: every connection proves that it comes from a member of
this generation before a byte of it lands in a receive slot, and the listener proves the
same to the sender before the sender sends a byte of its slot.

    sender s                                     listener l
    HELLO (magic, s, nonce_s)                 ─►  (Gate: the listener's accept thread)
                                              ◄─  CHALLENGE (magic, nonce_l, proof_l)
    checks proof_l; RESPONSE (proof_s)        ─►  checks proof_s: the connection is s's

Both proofs are HMAC-SHA256 with the job secret as key, over the connection's purpose,
fresh 16-byte nonces of both ends, the generation and both ranks::

    proof_l = HMAC(secret, "deadpool-mirror-listener" | P | nonce_s | nonce_l | gen | s | l)
    proof_s = HMAC(secret, "deadpool-mirror-sender"   | P | nonce_l | nonce_s | gen | s | l)
    K       = HMAC(secret, "deadpool-frame-key"       | P | nonce_s | nonce_l | gen | s | l)

(P: the purpose, ``mirror`` or ``handoff``, each ended by a zero byte; gen, s, l:
little-endian int64; the labels keep one side's proof from serving as the other's.) A proof
of another purpose, generation, rank pair or connection does not verify, so a recorded
handshake cannot be replayed, and one purpose's handshake fails in the other (a handoff
reuses ranks 0/1 under the same secret and generation). K, the connection's key, is never
sent: both ends derive it, and every message after the handshake carries a tag under it
(``frames.py``). The listener refuses a connection with a bad magic
(the unauthenticated ``DPOOLSK1`` hello of earlier versions included), an unknown rank, a
wrong proof, or no complete handshake within its deadline (``HANDSHAKE_S``). Handshakes run
in one selector loop on the listener's own thread, so a client that connects and sends
nothing delays no one else. The payload is not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional

NONCE_BYTES = 16
HELLO = struct.Struct(f"<QQ{NONCE_BYTES}s")  # magic, sender rank, the sender's nonce
HELLO_MAGIC = 0x44504F4F4C534B32  # "DPOOLSK2" (SK1: the unauthenticated hello, refused)
CHALLENGE = struct.Struct(f"<Q{NONCE_BYTES}s32s")  # magic, the listener's nonce, proof_l
RESPONSE = struct.Struct("<32s")  # proof_s
BINDING = struct.Struct("<qqq")  # generation, sender rank, listener rank
HANDSHAKE_S = 10.0  # a connection that has not proved itself by then is closed


PURPOSES = ("mirror", "handoff")


def proof(secret: str, role: str, first: bytes, second: bytes, gen: int, sender: int,
          listener: int, purpose: str = "mirror") -> bytes:
    """One side's proof, or the frame key (the module docstring has the exact binding)."""
    if purpose not in PURPOSES:
        raise ValueError(f"handshake purpose {purpose!r}, not one of {PURPOSES}")
    msg = (role.encode() + b"\0" + purpose.encode() + b"\0" + first + second
           + BINDING.pack(gen, sender, listener))
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def listener_proof(secret: str, nonce_s: bytes, nonce_l: bytes, gen: int, sender: int,
                   listener: int, purpose: str = "mirror") -> bytes:
    return proof(secret, "deadpool-mirror-listener", nonce_s, nonce_l, gen, sender, listener,
                 purpose)


def sender_proof(secret: str, nonce_l: bytes, nonce_s: bytes, gen: int, sender: int,
                 listener: int, purpose: str = "mirror") -> bytes:
    return proof(secret, "deadpool-mirror-sender", nonce_l, nonce_s, gen, sender, listener,
                 purpose)


def frame_key(secret: str, nonce_s: bytes, nonce_l: bytes, gen: int, sender: int,
              listener: int, purpose: str) -> bytes:
    return proof(secret, "deadpool-frame-key", nonce_s, nonce_l, gen, sender, listener,
                 purpose)


def prove(s: socket.socket, secret: str, gen: int, rank: int, dst: int,
          purpose: str = "mirror") -> bytes:
    """The sender's half, on a connected blocking socket: nothing but the hello goes to a
    listener that does not prove it holds the secret. Returns the connection's frame key.
    Raises ConnectionError."""
    nonce_s = os.urandom(NONCE_BYTES)
    s.sendall(HELLO.pack(HELLO_MAGIC, rank, nonce_s))
    magic, nonce_l, proof_l = CHALLENGE.unpack(read_exact(s, CHALLENGE.size))
    want = listener_proof(secret, nonce_s, nonce_l, gen, rank, dst, purpose)
    if magic != HELLO_MAGIC or not hmac.compare_digest(proof_l, want):
        s.close()
        raise ConnectionError(f"the listener of rank {dst} did not prove the job secret for "
                              f"generation {gen} ({purpose})")
    s.sendall(RESPONSE.pack(sender_proof(secret, nonce_l, nonce_s, gen, rank, dst, purpose)))
    return frame_key(secret, nonce_s, nonce_l, gen, rank, dst, purpose)


def read_exact(s: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return bytes(data)


class _Handshake:
    """The listener's half of one connection's handshake, fed as bytes arrive."""

    def __init__(self, gate: "Gate", sock: socket.socket, peer: str):
        self.gate, self.sock, self.peer = gate, sock, peer
        self.deadline = time.monotonic() + gate.deadline_s
        self.want, self.got = HELLO.size, bytearray()
        self.sender: Optional[int] = None
        self.nonce_s = self.nonce_l = self.key = b""

    def feed(self) -> Optional[str]:
        """Read what arrived. Returns why the connection is refused, "" once it proved
        itself, None while it is still incomplete."""
        try:
            data = self.sock.recv(self.want - len(self.got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            return f"{exc} during the handshake"
        if not data:
            return "closed during the handshake"
        self.got += data
        if self.sender is None and len(self.got) >= 8:
            (magic,) = struct.unpack_from("<Q", self.got)
            if magic != HELLO_MAGIC:
                return f"bad hello magic {magic:#x} (not a peer holding this job's protocol)"
        if len(self.got) < self.want:
            return None
        return self._hello() if self.sender is None else self._response()

    def _hello(self) -> Optional[str]:
        _, sender, self.nonce_s = HELLO.unpack(self.got)
        g = self.gate
        if not 0 <= sender < g.world_size:
            return f"claims rank {sender}, outside 0..{g.world_size - 1}"
        self.sender, self.nonce_l = sender, os.urandom(NONCE_BYTES)
        msg = CHALLENGE.pack(HELLO_MAGIC, self.nonce_l, listener_proof(
            g.secret, self.nonce_s, self.nonce_l, g.gen, sender, g.rank, g.purpose))
        try:
            if self.sock.send(msg) != len(msg):  # a fresh socket's buffer takes 56 bytes
                return "could not send the challenge at once"
        except OSError as exc:
            return f"{exc} while sending the challenge"
        self.want, self.got = RESPONSE.size, bytearray()
        return None

    def _response(self) -> str:
        g = self.gate
        (got,) = RESPONSE.unpack(self.got)
        want = sender_proof(g.secret, self.nonce_l, self.nonce_s, g.gen, self.sender, g.rank,
                            g.purpose)
        if not hmac.compare_digest(got, want):
            return (f"claims rank {self.sender} without proving the job secret for "
                    f"generation {g.gen} ({g.purpose})")
        self.key = frame_key(g.secret, self.nonce_s, self.nonce_l, g.gen, self.sender, g.rank,
                             g.purpose)
        return ""


class Gate:
    """The listener's accept thread: accepts every connection and runs its handshake, all
    in one selector loop, so that a silent or slow client holds up nobody else. A verified
    connection goes to ``admit(sender rank, socket, frame key)``; the rest to
    ``refuse(socket, peer address, why)``. It ends when the listener is shut down (an abort)
    or at ``stop``."""

    def __init__(self, listener: socket.socket, secret: str, gen: int, rank: int,
                 world_size: int, deadline_s: float,
                 admit: Callable[[int, socket.socket, bytes], None],
                 refuse: Callable[[socket.socket, str, str], None], purpose: str = "mirror"):
        self.listener, self.secret, self.gen, self.purpose = listener, secret, gen, purpose
        self.rank, self.world_size, self.deadline_s = rank, world_size, deadline_s
        self.admit, self.refuse = admit, refuse
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"deadpool-mirror-accept-{rank}")
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5.0)
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        pending: Dict[socket.socket, _Handshake] = {}
        try:
            while not self._stopping:
                wait = min((h.deadline for h in pending.values()), default=None)
                ready = sel.select(None if wait is None else max(0.0, wait - time.monotonic()))
                for key, _ in ready:
                    if key.fileobj is self.listener:
                        if not self._accept(sel, pending):
                            return  # the listener was shut down (abort) or closed
                    elif key.fileobj in pending:
                        self._step(sel, pending, pending[key.fileobj])
                self._expire(sel, pending)
        finally:
            for h in pending.values():
                h.sock.close()
            sel.close()

    def _accept(self, sel, pending) -> bool:
        try:
            s, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        s.setblocking(False)
        h = _Handshake(self, s, f"{addr[0]}:{addr[1]}")
        pending[s] = h
        sel.register(s, selectors.EVENT_READ)
        return True

    def _step(self, sel, pending, h: _Handshake) -> None:
        why = h.feed()
        if why is None:
            return
        sel.unregister(h.sock)
        del pending[h.sock]
        if why:
            self.refuse(h.sock, h.peer, why)
        else:
            self.admit(h.sender, h.sock, h.key)

    def _expire(self, sel, pending) -> None:
        now = time.monotonic()
        for h in [h for h in pending.values() if h.deadline <= now]:
            sel.unregister(h.sock)
            del pending[h.sock]
            self.refuse(h.sock, h.peer, f"no complete handshake in {self.deadline_s:g}s")
