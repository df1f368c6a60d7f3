"""Conformance: every mirror transport passes the same test (3 processes)."""

import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from megatron_deadpool.mirror.rounds import StoreRounds
from megatron_deadpool.mirror.socket_transport import SocketTransport
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.mirror.gloo_transport import GlooTransport
from megatron_deadpool.mirror.transport import TransportContext, create_transport, transport_names
from megatron_deadpool.recovery.classify import is_comm_failure

WORLD = 3
SECRET = "the-job-secret"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conformance(t, rank):
    # ring exchange of different sizes: rank r sends (r+1)*100 bytes valued r to r+1
    dst, src = (rank + 1) % WORLD, (rank - 1) % WORLD
    send = torch.full(((rank + 1) * 100,), rank, dtype=torch.uint8)
    recv = torch.empty(((src + 1) * 100,), dtype=torch.uint8)
    t.exchange([(dst, send)], [(src, recv)])
    assert torch.all(recv == src)
    # a receive buffer larger than what is sent: the bytes fill its prefix, the rest stays
    recv = torch.full((300,), 255, dtype=torch.uint8)
    t.exchange([(dst, torch.full((rank + 1,), rank, dtype=torch.uint8))], [(src, recv)])
    assert torch.all(recv[:src + 1] == src) and torch.all(recv[src + 1:] == 255)
    # many-to-one: everyone sends to 0
    bufs = {r: torch.empty(10, dtype=torch.uint8) for r in range(1, WORLD)}
    if rank == 0:
        t.exchange([], [(r, b) for r, b in bufs.items()])
        assert all(torch.all(b == r) for r, b in bufs.items())
    else:
        t.exchange([(0, torch.full((10,), rank, dtype=torch.uint8))], [])
    assert t.all_ok(True) is True
    assert t.all_ok(rank != 1) is False
    assert t.all_gather_json({"r": rank, "own": [rank, 5]}) == [
        {"r": r, "own": [r, 5]} for r in range(WORLD)]
    assert t.all_gather_int(rank + 7) == [7 + r for r in range(WORLD)]
    assert t.gather_from(rank * 10, [(rank - 1) % WORLD]) == {(rank - 1) % WORLD:
                                                              ((rank - 1) % WORLD) * 10}


def _peer_death(t, rank, store):
    """The last rank leaves without answering: every other member's call ends within its
    timeout, with an error that recovery takes for a peer failure (never a hang)."""
    store.add("conformed", 1)
    while store.add("conformed", 0) < WORLD:  # everyone passed the conformance part
        time.sleep(0.01)
    if rank == WORLD - 1:
        return  # gone: its process exits without joining the next call
    gone = WORLD - 1
    calls = {"all_ok": lambda: t.all_ok(True, timeout_s=2.0),
             # a send to the peer that left and a receive from it, in one call
             "exchange": lambda: t.exchange([(gone, torch.ones(1 << 20, dtype=torch.uint8))],
                                            [(gone, torch.empty(1 << 20, dtype=torch.uint8))],
                                            timeout_s=2.0)}
    # a call that never ended would leave this worker's result missing: the test fails at
    # its errq.get(timeout=120), with no wall-clock bound asserted here (issue 58)
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - checked right below
            assert is_comm_failure(exc), f"{name}: {type(exc).__name__}: {exc}"
        else:
            raise AssertionError(f"{name} returned although a member never called it")


def _worker(rank, kind, port, errq, group_collectives=False):
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, WORLD, rank == 0,
                                           wait_for_workers=False)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        # built by name through the registry, as the runtime builds it (control/link.py):
        # every transport's collectives are the store's signed rounds, which the gloo
        # transport's factory hands to the group it builds (``group_collectives``: none,
        # the group's own, for tests)
        gen = torch.distributed.PrefixStore("t/", store)
        rounds = StoreRounds(gen, rank, WORLD, timeout_s=60, secret=SECRET, gen=0)
        collectives = None if group_collectives else rounds
        t = create_transport(kind, TransportContext(gen, rank, WORLD, collectives,
                                                    "127.0.0.1", SECRET, 0, timeout_s=60))
        assert isinstance(t, GlooTransport) == (kind == "gloo") and t.kind == kind
        assert (t.rounds if kind == "gloo" else t.collectives) is collectives
        _conformance(t, rank)
        _peer_death(t, rank, store)
        t.release()  # the generation's end, as Links.release calls it
        errq.put(None)
    except BaseException:  # noqa: BLE001
        errq.put(traceback.format_exc())


def _tag_worker(rank, port, errq):
    """Rank 0 sends one message over the gloo transport under a key that is not the job's
    pair key; rank 1 must refuse it in ``exchange`` (its tag check), not take it."""
    try:
        from megatron_deadpool.mirror.frames import PeerLost
        from megatron_deadpool.mirror.gloo_transport import Tags

        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0,
                                           wait_for_workers=False)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
        gen = torch.distributed.PrefixStore("t/", store)
        rounds = StoreRounds(gen, rank, 2, timeout_s=60, secret=SECRET, gen=0)
        t = create_transport("gloo", TransportContext(gen, rank, 2, rounds, "127.0.0.1",
                                                      SECRET, 0, timeout_s=60))
        if rank == 0:
            t.tags = Tags("not-the-job-secret", 0, 0)  # a sender without the pair's key
            t.exchange([(1, torch.ones(64, dtype=torch.uint8))], [], timeout_s=30)
            errq.put(None)
            return
        try:
            t.exchange([], [(0, torch.empty(64, dtype=torch.uint8))], timeout_s=30)
        except PeerLost as exc:
            errq.put(None if "failed its tag" in str(exc) else repr(exc))
        else:
            errq.put("rank 1 took a message tagged under another key")
    except BaseException:  # noqa: BLE001
        errq.put(traceback.format_exc())


def test_the_gloo_transport_refuses_a_message_under_another_key():
    """Issue 58: with the tag check in ``GlooTransport.exchange`` removed, every other gloo
    test passed; here a message tagged under another key is refused by the receiver."""
    ctx = mp.get_context("spawn")
    errq, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_tag_worker, args=(r, port, errq)) for r in range(2)]
    for p in procs:
        p.start()
    errors = [errq.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert errors == [None, None], "\n".join(e for e in errors if e)


CONFORMANCE = ["gloo", "socket"]


def test_every_registered_transport_is_in_the_conformance_test():
    """A transport is one class, one registration and one entry in CONFORMANCE; the flag's
    choices are the registered ones, and one of them serves the drain's hand-off."""
    from megatron_deadpool.mirror.transport import choices, handoff_transport

    assert transport_names() == sorted(CONFORMANCE)
    assert sorted(choices()) == transport_names() and handoff_transport() in choices()
    with pytest.raises(ConfigError, match="unknown mirror transport 'carrier-pigeon'"):
        create_transport("carrier-pigeon", TransportContext(None, 0, 1, None))


@pytest.mark.parametrize("kind", CONFORMANCE + ["gloo-group-collectives"])
def test_transport_conformance(kind):
    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    port = _port()
    name, group = kind.split("-")[0], kind.endswith("group-collectives")
    procs = [ctx.Process(target=_worker, args=(r, name, port, errq, group))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    errors = [errq.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert errors == [None] * WORLD, "\n".join(e for e in errors if e)


def _pair(store=None):
    store = store or torch.distributed.HashStore()
    return [SocketTransport(store, r, 2, None, "127.0.0.1", SECRET, 3, timeout_s=60)
            for r in (0, 1)]


def test_socket_reachable_once_the_peer_listens():
    """``reachable`` (what a hand-off's sender polls) says, without waiting, whether the
    peer's listener is published."""
    store = torch.distributed.HashStore()
    t0 = SocketTransport(store, 0, 2, None, "127.0.0.1", SECRET, 3, timeout_s=60)
    assert t0.reachable(0) and not t0.reachable(1)
    t1 = SocketTransport(store, 1, 2, None, "127.0.0.1", SECRET, 3, timeout_s=60)
    assert t0.reachable(1) and t1.reachable(0)
    for t in (t0, t1):
        t.release()


@pytest.mark.parametrize("connected", [False, True])
def test_socket_abort_wakes_a_blocked_exchange(connected):
    """``abort()`` from another thread ends an exchange blocked on a peer that never sends,
    whether it waits for the peer's connection or for its bytes."""
    import threading

    t0, t1 = _pair()
    if connected:  # one message first: the connection 1 -> 0 exists
        buf = torch.empty(8, dtype=torch.uint8)
        th = threading.Thread(target=t1.exchange, args=([(0, torch.ones(8, dtype=torch.uint8))],
                                                          []))
        th.start()
        t0.exchange([], [(1, buf)])
        th.join()
        assert torch.all(buf == 1)
    out = {}

    def blocked():
        try:
            t0.exchange([], [(1, torch.empty(1 << 16, dtype=torch.uint8))])
        except Exception as exc:  # noqa: BLE001 - checked below
            out["exc"] = exc

    th = threading.Thread(target=blocked)
    th.start()
    time.sleep(0.3)
    assert th.is_alive()  # still waiting: nothing was sent
    t0.abort()
    th.join(10)
    assert not th.is_alive(), "abort() did not wake the exchange"
    assert is_comm_failure(out["exc"]), repr(out["exc"])
    for t in (t0, t1):
        assert t.release() is None


def test_socket_refuses_a_message_larger_than_the_receive_buffer():
    import threading

    from megatron_deadpool.mirror.socket_transport import PeerLost

    t0, t1 = _pair()
    th = threading.Thread(target=lambda: t1.exchange(
        [(0, torch.zeros(64, dtype=torch.uint8))], [], timeout_s=5))
    th.start()
    with pytest.raises(PeerLost, match="do not fit the 32-byte receive buffer"):
        t0.exchange([], [(1, torch.empty(32, dtype=torch.uint8))], timeout_s=5)
    th.join()
    # the rest of that message is still on the wire (zeros: it would read as an empty
    # message): the connection is not used again
    with pytest.raises(PeerLost):
        t0.exchange([], [(1, torch.empty(64, dtype=torch.uint8))], timeout_s=5)
    for t in (t0, t1):
        t.release()


def test_socket_listener_address_is_the_interface_the_other_nodes_reach():
    from megatron_deadpool.mirror.socket_transport import local_address

    routes = {"10.1.2.3": "10.1.0.7", "node001": "127.0.1.1", "10.255.255.255": "10.1.0.7",
              "127.0.0.1": "127.0.0.1"}
    route = routes.get
    assert local_address("10.1.2.3", route, {}) == "10.1.0.7"
    # the store named by a hostname that this host maps to a loopback alias
    assert local_address("node001", route, {}) == "10.1.0.7"
    assert local_address("127.0.0.1", route, {}) == "127.0.0.1"  # a one-host job
    assert local_address("node001", route, {"DEADPOOL_MIRROR_ADDR": "10.9.9.9"}) == "10.9.9.9"
    assert local_address("nowhere", lambda _: None, {}) == "127.0.0.1"


# ---------------------------------------------------------------- the authenticated handshake
def _addr(t):
    return t._listener.getsockname()[:2]


def _wait_for(cond, what: str, limit_s: float = 20.0) -> None:
    """Poll ``cond`` (a liveness bound for the test, not a timing assertion)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def _honest_send(t, dst: int, value: int, n: int = 64):
    import threading

    th = threading.Thread(target=t.exchange, args=(
        [(dst, torch.full((n,), value, dtype=torch.uint8))], []), kwargs={"timeout_s": 10})
    th.start()
    return th


def _bare_hello_impostor(t, claimed: int, n: int = 64) -> socket.socket:
    """A client of the old, unauthenticated protocol: HELLO(magic, rank), then a message."""
    import struct

    s = socket.create_connection(_addr(t))
    s.sendall(struct.pack("<QQ", 0x44504F4F4C534B31, claimed)
              + struct.pack("<Q", n) + bytes([0xEE]) * n)
    return s


def _wrong_secret_impostor(t, claimed: int, secret: str, gen: int) -> socket.socket:
    """A client of the current protocol that proves a wrong secret (or generation)."""
    from megatron_deadpool.mirror import handshake as hs

    s = socket.create_connection(_addr(t))
    nonce_s = b"n" * hs.NONCE_BYTES
    s.sendall(hs.HELLO.pack(hs.HELLO_MAGIC, claimed, nonce_s))
    _, nonce_l, _ = hs.CHALLENGE.unpack(hs.read_exact(s, hs.CHALLENGE.size))
    forged = hs.sender_proof(secret, nonce_l, nonce_s, gen, claimed, t.rank)
    s.sendall(hs.RESPONSE.pack(forged) + b"\xee" * 72)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    return True


@pytest.mark.parametrize("impostor", ["bare_hello", "wrong_secret", "wrong_generation"])
def test_socket_listener_refuses_a_foreign_client(impostor, caplog):
    """A client that does not prove the job secret for this generation (the old bare HELLO
    claiming rank 1, a wrong secret, a replay from another generation) is refused with a
    warning and never fills a receive slot; the honest rank 1 still gets through."""
    import logging

    t0, t1 = _pair()
    if impostor == "bare_hello":
        bad = _bare_hello_impostor(t0, claimed=1)
    else:
        secret, gen = ("guessed", t0.gen) if impostor == "wrong_secret" else (SECRET, 2)
        bad = _wrong_secret_impostor(t0, 1, secret, gen)
    with caplog.at_level(logging.WARNING, "megatron_deadpool.mirror.socket_transport"):
        th = _honest_send(t1, 0, value=1)
        buf = torch.zeros(64, dtype=torch.uint8)
        t0.exchange([], [(1, buf)], timeout_s=10)
        th.join()
        assert torch.all(buf == 1), "an impostor's bytes landed in the receive slot"
        _wait_for(lambda: t0.refused == 1, "the impostor was not refused")
    assert _closed_by_peer(bad)
    line = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(line) == 1 and "rank 0" in line[0] and "127.0.0.1:" in line[0], line
    for t in (t0, t1):
        t.release()


def test_socket_silent_client_does_not_stall_the_listener(monkeypatch):
    """A client that connects and sends nothing holds up no honest peer, and is closed once
    its handshake deadline passes."""
    from megatron_deadpool.mirror import handshake as hs

    monkeypatch.setattr(hs, "HANDSHAKE_S", 1.0)
    t0, t1 = _pair()
    silent = socket.create_connection(_addr(t0))  # connected first, never says a word
    th = _honest_send(t1, 0, value=7)
    buf = torch.zeros(64, dtype=torch.uint8)
    t0.exchange([], [(1, buf)], timeout_s=5)
    th.join()
    assert torch.all(buf == 7)
    _wait_for(lambda: t0.refused == 1, "the silent client was never closed")
    assert _closed_by_peer(silent)
    for t in (t0, t1):
        t.release()


def test_socket_sender_connects_only_to_a_signed_listener():
    """An address written into the store without the secret, or a listener that cannot prove
    the secret, gets no byte of a slot: the sender refuses it."""
    import threading

    from megatron_deadpool.membership import auth
    from megatron_deadpool.mirror import handshake as hs
    from megatron_deadpool.mirror import socket_transport as st

    store = torch.distributed.HashStore()
    t0, t1 = _pair(store)
    trap = socket.create_server(("127.0.0.1", 0))
    got = []

    def serve(answer: bytes):
        s, _ = trap.accept()
        s.settimeout(10)
        got.append(s.recv(4096))  # the sender's hello
        s.sendall(answer)
        got.append(_read_all(s))

    host, port = trap.getsockname()[:2]
    store.set(f"{st.KEY}0", f"{host}:{port}")  # an attacker overwrote rank 0's address
    with pytest.raises(st.PeerLost, match="not sealed with the job secret"):
        t1.exchange([(0, torch.ones(64, dtype=torch.uint8))], [], timeout_s=5)
    # a genuine seal (the listener that owned it is gone) on a listener that cannot prove
    _, t2 = _pair(store)
    store.set(f"{st.KEY}0", auth.seal(SECRET, {"gen": 3, "rank": 0, "addr": f"{host}:{port}"}))
    th = threading.Thread(target=serve, args=(hs.CHALLENGE.pack(hs.HELLO_MAGIC, b"l" * 16,
                                                                b"p" * 32),))
    th.start()
    with pytest.raises(st.PeerLost, match="did not prove the job secret"):
        t2.exchange([(0, torch.ones(64, dtype=torch.uint8))], [], timeout_s=5)
    th.join()
    assert len(got[0]) == hs.HELLO.size and got[1] == b"", "slot bytes went to an impostor"
    trap.close()
    for t in (t0, t1, t2):
        t.release()


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return out
            out += chunk
    except OSError:
        return out


def test_a_handshake_of_one_purpose_fails_in_the_other():
    """A drain's handoff reuses ranks 0/1 under the same secret and generation as the
    mirror: its handshake binds the purpose, so a handoff sender cannot reach a mirror
    listener (nor the reverse), and nothing it sends lands in a slot."""
    import threading

    from megatron_deadpool.mirror.frames import PeerLost

    for listener_purpose, sender_purpose in (("mirror", "handoff"), ("handoff", "mirror")):
        store = torch.distributed.HashStore()
        t0 = SocketTransport(store, 0, 2, None, "127.0.0.1", SECRET, 3, timeout_s=5,
                             purpose=listener_purpose)
        t1 = SocketTransport(store, 1, 2, None, "127.0.0.1", SECRET, 3, timeout_s=5,
                             purpose=sender_purpose)
        buf = torch.zeros(8, dtype=torch.uint8)
        got = {}

        def recv():
            try:
                t0.exchange([], [(1, buf)], timeout_s=3)
            except Exception as exc:  # noqa: BLE001 - checked below
                got["exc"] = exc

        th = threading.Thread(target=recv)
        th.start()
        with pytest.raises(PeerLost, match="did not prove the job secret"):
            t1.exchange([(0, torch.ones(8, dtype=torch.uint8))], [])
        th.join(10)
        assert "exc" in got and torch.all(buf == 0)
        for t in (t0, t1):
            t.release()


def test_every_message_carries_a_tag_under_its_connections_key():
    """frames.py: a message whose payload, sequence number or key is not the one the
    receiver expects fails its tag before anyone reads the slot; the right one passes."""
    import socket as so

    from megatron_deadpool.mirror import frames

    key, other = b"k" * 32, b"o" * 32

    def deliver(send_key, send_seq, recv_seq, flip=False):
        a, b = so.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        payload = torch.arange(64, dtype=torch.uint8)
        s = frames.Send(a, payload, send_key, send_seq)
        if flip:  # a byte altered on the way: rewrite the payload part before it is sent
            raw = bytearray(s.parts[1])
            raw[5] ^= 1
            s.parts[1] = memoryview(bytes(raw))
        assert s.step()
        into = torch.zeros(64, dtype=torch.uint8)
        r = frames.Recv(b, into, 1, key, recv_seq)
        try:
            assert r.step()
            return bool(torch.equal(into, payload))
        finally:
            a.close()
            b.close()

    assert deliver(key, 0, 0)
    assert deliver(key, 7, 7)
    for case in ((other, 0, 0, False), (key, 0, 1, False), (key, 0, 0, True)):
        with pytest.raises(frames.PeerLost, match="failed its tag"):
            deliver(*case)


def test_every_gloo_message_carries_a_tag_under_its_pairs_key():
    """gloo_transport.py (issue 49: it had no MAC): the trailer after each message binds
    the job secret, the generation, the pair, the position and the length; a message of
    another secret, generation, pair or position, or altered, fails its tag before anyone
    reads the slot, and the right one passes."""
    from megatron_deadpool.mirror.frames import PeerLost
    from megatron_deadpool.mirror.gloo_transport import Tags

    payload = torch.arange(64, dtype=torch.uint8)

    def deliver(sender: Tags, receiver: Tags, flip=False, into_n=100):
        trailer = sender.trailer(receiver.rank, payload)
        into = torch.full((into_n,), 255, dtype=torch.uint8)  # larger: the prefix is filled
        into[:64] = payload[:into_n]
        if flip:
            into[5] ^= 1
        receiver.check(sender.rank, into, trailer, receiver.next_in(sender.rank))

    deliver(Tags(SECRET, 4, 0), Tags(SECRET, 4, 1))
    a, b = Tags(SECRET, 4, 0), Tags(SECRET, 4, 1)
    deliver(a, b), deliver(a, b)  # each direction's sequence numbers advance together
    cases = {"another secret": (Tags("other", 4, 0), Tags(SECRET, 4, 1)),
             "another generation": (Tags(SECRET, 3, 0), Tags(SECRET, 4, 1)),
             "another pair": (Tags(SECRET, 4, 2), Tags(SECRET, 4, 1))}
    for why, (s, r) in cases.items():
        if why == "another pair":  # rank 2's message, taken as rank 0's
            with pytest.raises(PeerLost, match="failed its tag"):
                r.check(0, torch.cat([payload, payload]), s.trailer(1, payload), r.next_in(0))
            continue
        with pytest.raises(PeerLost, match="failed its tag"):
            deliver(s, r)
    s, r = Tags(SECRET, 4, 0), Tags(SECRET, 4, 1)
    s.trailer(1, payload)  # a message the receiver never took: a replay of #0 as #1
    with pytest.raises(PeerLost, match="failed its tag"):
        deliver(s, r)
    with pytest.raises(PeerLost, match="failed its tag"):
        deliver(Tags(SECRET, 4, 0), Tags(SECRET, 4, 1), flip=True)
    with pytest.raises(PeerLost, match="failed its tag"):  # claims more than was received
        deliver(Tags(SECRET, 4, 0), Tags(SECRET, 4, 1), into_n=32)
