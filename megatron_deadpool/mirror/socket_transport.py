"""The mirror's point-to-point exchange over plain TCP connections, moved by the mirror
thread itself; the collectives (commit, sizes) are the store's rounds (rounds.py).

Why: a snapshot job sends one message to each buddy and receives one from each owner. Over
gloo each message costs a ``Work`` object, Python dispatch, and wake-ups and reads on the
group's I/O thread; here one selector loop on the calling thread writes and reads the
bytes straight from and into the slots (``docs/benchmarks.md`` has the CPU before/after).

    sender s                                     listener l (a buddy of s)
    address of l: sealed in the generation's store, opened with the job secret
    connect, HELLO (magic, s, nonce_s)        ─►  accept thread: a handshake per connection
                                              ◄─  CHALLENGE (magic, nonce_l, proof_l)
    checks proof_l; RESPONSE (proof_s)        ─►  checks proof_s: the connection is s's
    [u64 length][the sealed slot][tag]        ─►  recv_into(l's receive slot for s), checked

Both ends prove that they hold the job secret, bound to the purpose (``mirror``, or a
drain's ``handoff``), this generation, both ranks and fresh nonces (``handshake.py`` has the
exact binding); a sender connects only to an address sealed with the secret for this
generation and rank (``membership/auth.py``). Every message then carries a tag under the
connection's own key (``frames.py``). A connection that fails is closed with one warning
line and counted (``refused``).

``timeout_s`` bounds the time in which no byte moves (a multi-GB slot may take longer in
all). One connection per (sender, receiver) pair, made on first use, lives for the generation
(a new generation makes a new transport; the old one is closed with its gloo group). The
recovery's abort calls ``abort`` here (``World.on_abort``), which shuts these connections
down and wakes a loop blocked here at once; a peer that just vanishes ends the call at its deadline.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch

from ..base import counts
from ..base.errors import TransportTimeout
from ..membership import auth
from . import handshake
from .frames import LENGTH, PeerLost, Recv, Send  # noqa: F401 - LENGTH: impostor.py's
from .transport_api import MirrorTransport, count_messages

log = logging.getLogger(__name__)

KEY = "deadpool-mirror-socket/"


def _route_source(toward: str) -> Optional[str]:
    """The local address the kernel would send from to reach ``toward`` (a UDP connect only
    picks the route: no packet is sent); None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def local_address(toward: str, route=_route_source, environ=os.environ) -> str:
    """The address this process's mirror listener is published under: ``DEADPOOL_MIRROR_ADDR``
    if set, else this host's address on the route to ``toward`` (the store's host), the
    interface the other nodes reach it by. When ``toward`` is a name that this host resolves
    to a loopback alias (Debian's 127.0.1.1 for its own hostname) while the other nodes do
    not, the default route's address is taken instead; loopback only when the store itself
    is named as loopback (every process on this host)."""
    if environ.get("DEADPOOL_MIRROR_ADDR"):
        return environ["DEADPOOL_MIRROR_ADDR"]
    addr = route(toward)
    if addr is None or (_is_loopback(addr) and not _is_loopback(toward)):
        addr = route("10.255.255.255") or addr  # any non-local address: the default route
    return addr or "127.0.0.1"


class SocketTransport(MirrorTransport):
    kind = "socket"

    def __init__(self, store, rank: int, world_size: int, collectives: MirrorTransport,
                 host: str, secret: str, gen: int, timeout_s: float = 600.0,
                 purpose: str = "mirror", at: Optional[Callable[[int], Any]] = None):
        """``store``: this generation's (every member publishes its listener there, sealed;
        ``at(r)``, when given: rank r's node's record store, where r publishes and its peers
        read);
        ``collectives``: the transport ``all_ok`` / ``all_gather_*`` go to; ``secret``: the
        job's (``auth.load_secret``), ``gen``: this generation, ``purpose``: ``mirror`` or
        ``handoff``, all bound into every handshake."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self._at = at or (lambda r: store)
        self.collectives, self.timeout_s = collectives, timeout_s
        self.secret, self.gen, self.purpose = secret, gen, purpose
        self._listener = socket.create_server((host, 0), backlog=max(16, world_size))
        self._listener.setblocking(False)
        self._out: Dict[int, socket.socket] = {}
        self._in: Dict[int, socket.socket] = {}
        self._keys: Dict[socket.socket, bytes] = {}  # each connection's frame key
        self._seq: Dict[socket.socket, int] = {}  # messages on it so far (one direction)
        self._replaced: List[socket.socket] = []  # a peer's older connections, closed at release
        self._arrived = threading.Condition()  # the accept thread hands connections over
        self._sel = selectors.DefaultSelector()
        self._aborted = False
        self.refused = 0  # connections closed in the handshake (warned about one by one)
        self._gate = handshake.Gate(self._listener, secret, gen, rank, world_size,
                                    min(handshake.HANDSHAKE_S, timeout_s), self._admit,
                                    self._refuse, purpose)
        self._at(rank).set(f"{KEY}{rank}", auth.seal(secret, {
            "gen": gen, "rank": rank, "addr": f"{host}:{self._listener.getsockname()[1]}"}))

    def where(self, rank: int):
        """The store that holds ``rank``'s listener address (its node's record store)."""
        return self._at(rank)

    def reachable(self, peer: int) -> bool:
        """Whether ``peer``'s listener is published (one store check, no wait)."""
        return self._at(peer).check([f"{KEY}{peer}"])

    # ------------------------------------------------------------------ connections
    def _remaining(self, deadline: float, what: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"mirror {what}: no answer in {self._limit:g}s")
        return left

    def _address(self, dst: int, deadline: float) -> str:
        """``dst``'s listener address, as ``dst`` sealed it for this generation."""
        key = f"{KEY}{dst}"
        try:
            self._at(dst).wait([key], timedelta(seconds=self._remaining(deadline, "connect")))
        except Exception as exc:  # noqa: BLE001 - the store's timeout error type varies
            raise TransportTimeout(f"mirror connect: rank {dst} published no address in "
                                   f"{self._limit:g}s") from exc
        try:
            return auth.open_(self.secret, self._at(dst).get(key), gen=self.gen,
                              rank=dst)["addr"]
        except auth.AuthError as exc:
            raise PeerLost(f"mirror connect: the address of rank {dst} in the store is not "
                           f"sealed with the job secret for generation {self.gen}: "
                           f"{exc}") from None

    def _out_conn(self, dst: int, deadline: float) -> socket.socket:
        s = self._out.get(dst)
        if s is not None:
            return s
        addr = self._address(dst, deadline)
        host, port = addr.rsplit(":", 1)
        try:
            s = socket.create_connection((host, int(port)),
                                         timeout=self._remaining(deadline, "connect"))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = handshake.prove(s, self.secret, self.gen, self.rank, dst, self.purpose)
        except OSError as exc:
            raise PeerLost(f"mirror connect to rank {dst} at {addr}: {exc}") from exc
        s.setblocking(False)
        counts.add("connections")
        with self._arrived:
            self._keys[s], self._seq[s] = key, 0
        self._out[dst] = s
        return s

    def _in_conn(self, src: int, deadline: float) -> socket.socket:
        """``src``'s connection, once the accept thread has verified it."""
        with self._arrived:
            while src not in self._in:
                self._check_open()
                self._arrived.wait(self._remaining(deadline, "accept"))
            return self._in[src]

    def _admit(self, peer: int, s: socket.socket, key: bytes) -> None:
        """(accept thread) ``s`` proved to be ``peer``'s: the newest connection serves."""
        s.setblocking(False)
        counts.add("connections")
        with self._arrived:
            self._keys[s], self._seq[s] = key, 0
            old = self._in.pop(peer, None)
            if old is not None:
                self._replaced.append(old)  # the mirror thread may still be reading it
            self._in[peer] = s
            self._arrived.notify_all()

    def _refuse(self, s: socket.socket, peer: str, why: str) -> None:
        """(accept thread) Close a connection that failed the handshake: one warning line."""
        self.refused += 1
        log.warning("mirror listener of rank %d (generation %d) refused a connection from %s: "
                    "%s", self.rank, self.gen, peer, why)
        s.close()

    # ------------------------------------------------------------------ the exchange
    def exchange(self, sends, recvs, timeout_s=None) -> None:
        try:
            self._exchange(sends, recvs, timeout_s)
        except BaseException:
            self.abort()  # a half-sent message would misframe the next: no next on these
            raise

    def _exchange(self, sends, recvs, timeout_s) -> None:
        self._check_open()
        self._limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + self._limit
        count_messages(sends, recvs)
        out = [self._framed(Send, self._out_conn(dst, deadline), buf) for dst, buf in sends]
        into = [self._framed(Recv, self._in_conn(src, deadline), buf, src)
                for src, buf in recvs]
        pending = [op for op in (*out, *into) if not op.step()]  # most finish right here
        if not pending:
            return
        for op in pending:
            self._sel.register(op.sock, op.event, op)
        try:
            while pending:
                ready = self._sel.select(self._remaining(deadline, "exchange"))
                self._check_open()
                if ready:  # the bound is on silence: a large slot may take longer in all
                    deadline = time.monotonic() + self._limit
                for key, _ in ready:
                    op = key.data
                    if op.step():
                        self._sel.unregister(op.sock)
                        pending.remove(op)
        finally:
            for op in pending:
                self._sel.unregister(op.sock)

    def _framed(self, op, sock: socket.socket, buf: torch.Tensor, *src: int):
        """The next message on ``sock``, under its key and sequence number."""
        with self._arrived:
            key, seq = self._keys[sock], self._seq[sock]
            self._seq[sock] = seq + 1
        return op(sock, buf, *src, key, seq)

    # ------------------------------------------------------------------ collectives
    def all_ok(self, ok: bool, timeout_s=None) -> bool:
        return self.collectives.all_ok(ok, timeout_s)

    def all_gather_int(self, value: int, timeout_s=None) -> List[int]:
        return self.collectives.all_gather_int(value, timeout_s)

    def all_gather_json(self, obj, timeout_s=None) -> List:
        return self.collectives.all_gather_json(obj, timeout_s)

    def gather_from(self, value, ranks, timeout_s=None) -> Dict[int, Any]:
        return self.collectives.gather_from(value, ranks, timeout_s)

    def _sockets(self) -> List[socket.socket]:
        with self._arrived:
            return [*self._out.values(), *self._in.values(), *self._replaced, self._listener]

    def _check_open(self) -> None:
        if self._aborted:
            raise PeerLost("mirror exchange: transport aborted (recovery began, or an "
                           "earlier exchange on it failed)")

    def abort(self) -> None:
        self._aborted = True  # bytes already received are not read as a message
        for s in self._sockets():
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a select on it (a listener's too)
            except OSError:
                pass
        with self._arrived:
            self._arrived.notify_all()  # an exchange waiting for a connection

    def release(self):
        self._gate.stop()
        for s in self._sockets():
            s.close()
        self._out.clear()
        self._in.clear()
        self._replaced.clear()
        self._keys.clear()
        self._seq.clear()
        self._sel.close()
        return self.collectives.release() if self.collectives is not None else None
