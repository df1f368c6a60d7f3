"""The 'impostor' test fault (``base/faults.py``): a client without the job secret knocks on every
mirror listener of the generation, the way an attacker on the network would, while the job
trains. The listeners must refuse it and the run must not notice (``tests/scenarios.py``:
``impostor_mirror_peer``).

Per listener, three connections: the old unauthenticated hello (``HELLO(magic, rank)``,
followed by a message that would have landed in a receive slot), the current hello answered
with a proof under a wrong secret, and a connection that says nothing and stays open past
the handshake deadline. The addresses are read from the stores as anyone can (they are
public, only signed): each rank's on its node's record store."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from typing import List, Tuple

from . import handshake as hs
from . import socket_transport as st

log = logging.getLogger(__name__)
OLD_HELLO = struct.Struct("<QQ")
OLD_MAGIC = 0x44504F4F4C534B31  # "DPOOLSK1": the hello before the handshake was signed


def start(transport) -> threading.Thread:
    """Knock on every listener of ``transport``'s generation from a daemon thread."""
    th = threading.Thread(target=_run, args=(transport,), daemon=True,
                          name="deadpool-impostor")
    th.start()
    return th


def _run(transport) -> None:
    if not isinstance(transport, st.SocketTransport):
        log.warning("impostor: the mirror transport is %s, not socket: nothing to knock on",
                    getattr(transport, "kind", None))
        return
    silent: List[socket.socket] = []
    for rank, addr in _addresses(transport):
        claimed = (rank + 1) % transport.world_size
        for knock in (_bare_hello, _wrong_secret, _silent):
            try:
                s = knock(addr, claimed, transport.gen)
            except OSError as exc:  # refused at once: what a listener may do
                log.info("impostor: %s on rank %d's listener: %s", knock.__name__, rank, exc)
                continue
            silent.append(s)
        log.warning("impostor: knocked on rank %d's mirror listener at %s:%d", rank, *addr)
    time.sleep(hs.HANDSHAKE_S + 1.0)  # the silent ones outlive their handshake deadline
    for s in silent:
        s.close()


def _addresses(transport) -> List[Tuple[int, Tuple[str, int]]]:
    out = []
    for rank in range(transport.world_size):
        try:
            body = json.loads(transport.where(rank).get(f"{st.KEY}{rank}"))["body"]
        except Exception as exc:  # noqa: BLE001 - a rank without a listener is skipped
            log.info("impostor: no address of rank %d: %s", rank, exc)
            continue
        host, port = body["addr"].rsplit(":", 1)
        out.append((rank, (host, int(port))))
    return out


def _bare_hello(addr, claimed: int, gen: int) -> socket.socket:
    s = socket.create_connection(addr, timeout=10)
    s.sendall(OLD_HELLO.pack(OLD_MAGIC, claimed) + st.LENGTH.pack(64) + b"\xee" * 64)
    return s


def _wrong_secret(addr, claimed: int, gen: int) -> socket.socket:
    s = socket.create_connection(addr, timeout=10)
    nonce_s = os.urandom(hs.NONCE_BYTES)
    s.sendall(hs.HELLO.pack(hs.HELLO_MAGIC, claimed, nonce_s))
    _, nonce_l, _ = hs.CHALLENGE.unpack(hs.read_exact(s, hs.CHALLENGE.size))
    forged = hs.sender_proof("not-the-job-secret", nonce_l, nonce_s, gen, claimed, 0)
    s.sendall(hs.RESPONSE.pack(forged) + st.LENGTH.pack(64) + b"\xee" * 64)
    return s


def _silent(addr, claimed: int, gen: int) -> socket.socket:
    return socket.create_connection(addr, timeout=10)
