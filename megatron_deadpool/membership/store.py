"""Coordinator store: key names, connection with the job token, and the event queue.

One TCPStore, hosted by the launcher agent of node 0 (the node that runs the batch step: if
it dies, Slurm ends the job anyway, so the coordinator adds no failure domain). Every value
below marked (signed) is sealed with the job secret for its slot (``auth.py``). Keys::

    dp/events/n, dp/events/{i}     append-only event queue read by the decider (signed, i)
                                   kinds: EventKind below
    dp/admit/{lid}/{nonce}         the decider's answer to one join request (signed)
    dp/spare_node/{nonce}          the decider's answer to a joining spare node (signed)
    dp/drain/{nonce}               the decider's answer to a drain request (signed)
    dp/job_env                     what every worker is told (WorkerEnv, signed)
    dp/latest                      the current generation (signed, only grows)
    dp/plan/{g}                    JSON plan of generation g (signed, gen)
    dp/failing/{g}                 a member of g was declared dead; its replacement plan
                                   may take a while (signed, gen)
    dp/hb/{lid}, dp/agent_hb/{n}   worker and node-agent heartbeats (signed)
    dp/node_store/{n}             where node n's agent serves its ranks' round records (signed;
                                  the decider carries it in every plan's node_stores)
    dp/cmd/{node}/n, .../{i}       commands for a node agent (signed, node and i; CommandOp)
    dp/inject/{i}                  counter: the first process to reach fault i claims it
    dp/report/{g}/{r}, boundary/.. rank r's recovery timings of generation g, the iteration
                                   it stops at for a planned g (signed, g and r)
    dp/shutdown                    set once: the job is over (signed reason)
    gen{g}/...                     torch.distributed rendezvous of generation g (PrefixStore)
"""

from __future__ import annotations

import enum
import logging
import re
import secrets
import socket
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..base import counts
from ..base.errors import TokenError, stopped
from ..base.plan import Plan, apply_delta
from ..base.plan import delta as plan_delta
from . import auth
from . import records
from .records import CountedQueue, OwnedSlots, get_now, peek

log = logging.getLogger(__name__)

ROOT = "dp/"
# A request nonce names a store key (dp/admit/{lid}/{nonce}, ...): a genuine one is
# secrets.token_hex(8). Anything else that a record claims is no key: a lone surrogate
# cannot be sent to the store at all (TypeError), a "/" would name another record.
NONCE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def well_formed_nonce(nonce) -> bool:
    return isinstance(nonce, str) and NONCE.fullmatch(nonce) is not None


ADMIT_SLICE_S = 1.0  # a joining process looks for the job's shutdown this often


class EventKind(str, enum.Enum):
    JOIN = "join"                    # a process asks for admission (lid, nonce)
    EXIT = "exit"                    # its node agent saw a process exit (lid, code)
    DONE = "done"                    # a rank finished training
    FATAL = "fatal"                  # a rank stops on a local error (error, traceback)
    STARTUP_ERROR = "startup_error"  # a process fails before it attached (startup.py)
    FAULT_REQUEST = "fault_request"  # a scheduled test fault fired (index, iteration)
    SPARE_NODE = "spare_node"        # an agent offers a spare node (procs, nonce)
    DRAIN_REQUEST = "drain_request"  # move a node's ranks to spares (node, reason: drain.py)
    FORGED = "forged"                # not a sender's kind: a message that did not verify


class CommandOp(str, enum.Enum):
    SIGNAL = "signal"                # deliver ``signal`` to the processes ``lids``
    SPAWN = "spawn"                  # start standby process ``lid`` in the slot of ``replaces``


def k(*parts: Any) -> str:
    return ROOT + "/".join(str(p) for p in parts)


def connect(host: str, port: int, timeout_s: float = 60.0, is_master: bool = False):
    """A client of the job's store; the host (``is_master``) listens on ``host`` only, not
    on every interface."""
    from torch.distributed import TCPStore

    fd = _listening(host, port, reuse=True)[0] if is_master else None
    return TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)


def serve_records(facing: str, timeout_s: float = 60.0):
    """A store server for a node's round records (``Coordinator.publish_node_store``), on
    the interface this host reaches ``facing`` (the job's store host) by, at a free port.
    Returns (server, host, port)."""
    from torch.distributed import TCPStore

    probe = socket.socket(socket.AF_INET6 if ":" in facing else socket.AF_INET,
                          socket.SOCK_DGRAM)
    try:
        probe.connect((facing, 9))  # no packet is sent: it only picks the route
        host = probe.getsockname()[0]
    except OSError:
        host = facing
    finally:
        probe.close()
    fd, port = _listening(host, 0)
    server = TCPStore(host, port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    return server, host, port


def _listening(host: str, port: int, reuse: bool = False) -> Tuple[int, int]:
    """A listening socket on ``host`` only (not on every interface), for a TCPStore
    server: its file descriptor and its port (``port`` 0: a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if reuse:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    bound = sock.getsockname()[1]
    return sock.detach(), bound


class Coordinator:
    """The store as job members use it: every message sealed with the job secret (see
    ``auth.py``) and opened only if it verifies for its slot. Forged, unsigned or misplaced
    (copied to another slot) messages are never acted on (events come back as kind
    "forged"); a genuine one written back to its own slot is left to its reader (``auth``)."""

    def __init__(self, store, secret: str):
        self.raw, self.secret = store, secret
        self._gen = 0
        self._queues: Dict[str, CountedQueue] = {}  # the counted queues this reader reads
        self.owned = OwnedSlots(store)  # the single-slot records this writer put back (heal)
        self._done: set = set()  # generations whose every rank reported (generation_done)
        self._plans: Dict[int, Plan] = {}  # the plans this reader or writer holds, by gen

    # -------------------------------------------------------------- events
    def push_event(self, kind: str, **fields) -> None:
        records.append(self.raw, k("events", "n"), lambda i: k("events", i), lambda i: auth.seal(
            self.secret, {"i": i, "kind": kind, "t": time.time(), **fields}))

    def read_events(self, start: int) -> List[dict]:
        """Events with index > start (1-based), each with its index ``i`` (the reader's next
        ``start``); a record that does not verify, or a stretch of indices counted but never
        written (records.py), becomes {"kind": "forged", "i": ..., "why": ..., "claimed": <its
        unverified body>}."""
        out = []
        for i, raw, why in self._queue("events").read(start):
            try:
                if raw is None:
                    raise auth.AuthError(why)
                out.append(auth.open_(self.secret, raw, i=i))
            except auth.AuthError as exc:
                out.append({"kind": EventKind.FORGED, "i": i, "why": str(exc), "claimed": peek(raw)})
        return out

    def _queue(self, *name) -> CountedQueue:
        if k(*name) not in self._queues:
            self._queues[k(*name)] = CountedQueue(self.raw, k(*name, "n"), lambda i: k(*name, i))
        return self._queues[k(*name)]

    # -------------------------------------------------------------- plans
    def publish_plan(self, plan: Plan) -> None:
        """The plan of ``plan.gen``, its delta from the plan this writer published before
        (when that is ``gen - 1``: what a survivor reads), then the pointer to it."""
        g = plan.gen
        prev = self._plans.get(g - 1)
        if prev is not None:
            self.owned.set(k("plan_delta", g), auth.seal(self.secret, plan_delta(prev, plan)),
                           k("plan_delta", g - 1))
        self.owned.set(k("plan", g), auth.seal(self.secret, plan.to_json()), k("plan", g - 1))
        self.owned.set(k("latest"), auth.seal(self.secret, {"gen": g}))
        self._keep(plan)

    def current_gen(self) -> int:
        """The newest generation with a valid signed pointer (a forged one is ignored)."""
        raw = get_now(self.raw, k("latest"))
        if raw is not None:
            try:
                self._gen = max(self._gen, int(auth.open_(self.secret, raw)["gen"]))
            except (auth.AuthError, KeyError, TypeError, ValueError):
                pass
        return self._gen

    def declare_failing(self, gen: int) -> None:
        self.owned.set(k("failing", gen), auth.seal(self.secret, {"gen": gen}), k("failing", gen - 1))

    def is_failing(self, gen: int) -> bool:
        raw = get_now(self.raw, k("failing", gen))
        if raw is None:
            return False
        try:
            return auth.open_(self.secret, raw, gen=gen)["gen"] == gen
        except (auth.AuthError, KeyError):
            return False

    def generation_done(self, plan: Plan) -> bool:
        """Every rank of ``plan`` reported its recovery's first step (generation 0: none)."""
        if plan.gen not in self._done and (
                plan.gen == 0 or self.rank_records("report", plan.gen, plan.world_size)):
            self._done.add(plan.gen)  # verified once, not at every step of the decider
        return plan.gen in self._done

    def get_plan(self, gen: int) -> Plan:
        """Generation ``gen``'s plan: from the plan of ``gen - 1`` this reader holds and the
        signed delta (O(changed ranks) bytes), else the full signed plan (O(W) bytes: a
        promoted spare, a skipped generation, a delta missing, forged or not giving the
        plan's digest). Raises auth.AuthError when the full plan does not verify."""
        if gen in self._plans:
            return self._plans[gen]
        prev, plan = self._plans.get(gen - 1), None
        if prev is not None:
            raw = get_now(self.raw, k("plan_delta", gen))
            counts.add("bytes", len(raw or b""))
            try:
                plan = apply_delta(prev, auth.open_(self.secret, raw, gen=gen))
            except (auth.AuthError, ValueError):
                plan = None  # the full plan below says whether anything is wrong
        if plan is None:
            raw = self.raw.get(k("plan", gen))
            counts.add("bytes", len(raw))
            plan = Plan.from_json(auth.open_(self.secret, raw, gen=gen))
        self._keep(plan)
        return plan

    def _keep(self, plan: Plan) -> None:
        """Hold the newest plans (the next delta is read against them)."""
        self._plans[plan.gen] = plan
        for g in [g for g in self._plans if g < plan.gen - 1]:
            del self._plans[g]

    # -------------------------------------------------------------- admission
    def request_admission(self, lid: int, timeout_s: float) -> None:
        """Ask to join; the decider answers with a sealed admission for this request's
        nonce. Raises TokenError when refused or when the answer is not signed with this
        process's secret (a wrong DEADPOOL_TOKEN)."""
        nonce = secrets.token_hex(8)
        self.push_event(EventKind.JOIN, lid=lid, nonce=nonce)
        key = k("admit", lid, nonce)
        self._wait_unless_stopped(key, timeout_s)
        try:
            body = auth.open_(self.secret, self.raw.get(key), lid=lid, nonce=nonce)
        except auth.AuthError:
            raise TokenError(f"coordinator refused process {lid}: the job secret does not "
                             "match (wrong DEADPOOL_TOKEN)") from None
        if not body.get("ok"):
            raise TokenError(f"coordinator refused process {lid}: {body.get('why')}")

    def _wait_unless_stopped(self, key: str, timeout_s: float) -> None:
        """Wait for ``key`` in slices of ADMIT_SLICE_S; raises JobStopped once the job has
        shut down meanwhile (a standby started to refill a node as the job completed was
        never answered: it waited out the whole rendezvous timeout, and the launcher with
        it: 120 s at the end of every job with a local restart), and the store's timeout
        error after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not records.waited(self.raw, [key], min(ADMIT_SLICE_S,
                                                       deadline - time.monotonic())):
            if time.monotonic() >= deadline:  # the store's own timeout error, as before
                self.raw.wait([key], timedelta(milliseconds=1))
                return
            reason = self.shutdown_reason()
            if reason is not None:
                raise stopped(f"{reason} (before this process was admitted)")

    def check_secret(self, timeout_s: float) -> None:
        """For a node agent that does not host the store: the job's first plan must open
        with this process's secret. Raises TokenError (a wrong DEADPOOL_TOKEN) before the
        agent starts anything."""
        self.raw.wait([k("plan", 0)], timedelta(seconds=timeout_s))
        try:
            self.get_plan(0)
        except auth.AuthError:
            raise TokenError("the coordinator's plan is not signed with this node's job "
                             "secret (wrong DEADPOOL_TOKEN)") from None

    def request_spare_node(self, procs: int, timeout_s: float) -> Tuple[int, List[int]]:
        """A node agent started with --join-as-spare: (its node id, its process ids)."""
        nonce = secrets.token_hex(8)
        self.push_event(EventKind.SPARE_NODE, procs=procs, nonce=nonce)
        key = k("spare_node", nonce)
        self.raw.wait([key], timedelta(seconds=timeout_s))
        body = auth.open_(self.secret, self.raw.get(key), nonce=nonce)
        return int(body["node"]), [int(x) for x in body["lids"]]

    def answer_spare_node(self, nonce: str, node: int, lids: List[int]) -> None:
        if not well_formed_nonce(nonce):
            return  # no key is made of it (the decider refuses such a request first)
        self.raw.set(k("spare_node", nonce), auth.seal(
            self.secret, {"nonce": nonce, "node": node, "lids": lids}))

    def request_drain(self, timeout_s: float, **fields) -> dict:
        """``deadpool drain`` (node, reason, to_standby, text): the decider's answer."""
        nonce = secrets.token_hex(8)
        self.push_event(EventKind.DRAIN_REQUEST, nonce=nonce, **fields)
        self.raw.wait([k("drain", nonce)], timedelta(seconds=timeout_s))
        return auth.open_(self.secret, self.raw.get(k("drain", nonce)), nonce=nonce)

    def answer_drain(self, nonce: str, body: dict) -> None:
        if not well_formed_nonce(nonce):
            return  # no key is made of it: its sender waits in vain, the decider goes on
        self.raw.set(k("drain", nonce), auth.seal(self.secret, {"nonce": nonce, **body}))

    def publish_job_env(self, env: Dict[str, str]) -> None:
        self.raw.set(k("job_env"), auth.seal(self.secret, {"env": env}))

    def job_env(self, timeout_s: float) -> Dict[str, str]:
        self.raw.wait([k("job_env")], timedelta(seconds=timeout_s))
        return auth.open_(self.secret, self.raw.get(k("job_env")))["env"]

    def answer_admission(self, lid: int, nonce: str, ok: bool, why: str = "") -> None:
        if not well_formed_nonce(nonce):
            return  # no key is made of it (the decider refuses such a request first)
        self.raw.set(k("admit", lid, nonce), auth.seal(
            self.secret, {"lid": lid, "nonce": nonce, "ok": ok, "why": why}))

    def refuse_forged_join(self, claimed: dict) -> None:
        """A join request that did not verify is refused, so its sender stops waiting."""
        lid, nonce = claimed.get("lid"), claimed.get("nonce")
        if claimed.get("kind") == EventKind.JOIN and isinstance(lid, int) and \
                well_formed_nonce(nonce):  # a forger's key stays short, and one key
            self.answer_admission(lid, nonce, ok=False, why="wrong job secret")

    # -------------------------------------------------------------- shutdown
    def set_shutdown(self, reason: str) -> bool:
        if self.shutdown_reason() is not None:
            return False
        self.owned.set(k("shutdown"), auth.seal(self.secret, {"reason": reason}))
        return True

    def shutdown_reason(self) -> Optional[str]:
        raw = get_now(self.raw, k("shutdown"))
        if raw is None:
            return None
        try:
            return auth.open_(self.secret, raw)["reason"]
        except (auth.AuthError, KeyError):
            return None

    # -------------------------------------------------------------- heartbeats
    def beat(self, lid: int, **fields) -> None:
        self.raw.set(k("hb", lid), auth.seal(self.secret, {"lid": lid, **fields}))

    def heartbeats(self, lids: Sequence[int]) -> Dict[int, dict]:
        out = {}
        for lid in lids:
            raw = get_now(self.raw, k("hb", lid))  # never a wait on a deleted key
            try:
                out[lid] = auth.open_(self.secret, raw, lid=lid)
            except auth.AuthError:  # missing, or not signed for it
                continue
        return out

    def agent_beat(self, node: int, seq: int) -> None:
        self.raw.set(k("agent_hb", node), auth.seal(self.secret, {"node": node, "seq": seq}))

    def publish_node_store(self, node: int, host: str, port: int) -> None:
        """Node ``node``'s record store (``launch/agent.py``): its agent serves the round
        records that its ranks read (mirror/rounds.py), so that no one server carries
        every rank's rounds (issue 57)."""
        self.raw.set(k("node_store", node), auth.seal(self.secret, {"node": node, "host": host,
                                                                    "port": port}))

    def node_store(self, node: int) -> Optional[Tuple[str, int]]:
        """(host, port) of node ``node``'s record store; None when it published none or the
        record does not verify (then its ranks' records stay on the generation's store)."""
        raw = get_now(self.raw, k("node_store", node))
        if raw is None:
            return None
        try:
            body = auth.open_(self.secret, raw, node=node)
            host, port = body["host"], body["port"]
        except (auth.AuthError, KeyError):
            log.warning("node %s's record store address does not verify: its ranks' round "
                        "records stay on the generation's store", node)
            return None
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            return None
        return host, port

    def agent_heartbeat(self, node: int) -> Optional[int]:
        raw = get_now(self.raw, k("agent_hb", node))
        if raw is None:
            return None
        try:
            return int(auth.open_(self.secret, raw, node=node)["seq"])
        except (auth.AuthError, KeyError):
            return None

    # -------------------------------------------------------------- agent commands
    def push_command(self, node: int, cmd: dict) -> None:
        records.append(self.raw, k("cmd", node, "n"), lambda i: k("cmd", node, i),
                       lambda i: auth.seal(self.secret, {**cmd, "node": node, "i": i}))

    def read_commands(self, node: int, start: int) -> Tuple[List[dict], int, int]:
        """(verified commands after ``start``, new cursor, how many were rejected: records
        that do not verify and stretches counted but never written, records.py)."""
        out, bad, cursor = [], 0, start
        for i, raw, _ in self._queue("cmd", node).read(start):
            cursor = i
            try:
                out.append(auth.open_(self.secret, raw, node=node, i=i))
            except auth.AuthError:
                bad += 1
        return out, cursor, bad

    # -------------------------------------------------------------- per-rank records
    def put_rank_record(self, what: str, gen: int, rank: int, body: dict) -> None:
        """A rank's ``report`` or ``boundary`` for generation ``gen`` (signed for the slot)."""
        self.raw.set(k(what, gen, rank), auth.seal(self.secret, {**body, "gen": gen, "rank": rank}))

    def rank_record(self, what: str, gen: int, rank: int) -> Optional[dict]:
        """A rank's verified record, or None (not there, or forged: its rank rewrites it)."""
        raw = get_now(self.raw, k(what, gen, rank))
        try:
            return None if raw is None else auth.open_(self.secret, raw, gen=gen, rank=rank)
        except auth.AuthError:
            return None

    def rank_records(self, what: str, gen: int, world_size: int) -> Optional[List[dict]]:
        """Every rank's verified ``what`` record of ``gen``, or None until all are there."""
        if not self.raw.check([k(what, gen, r) for r in range(world_size)]):
            return None
        got = [self.rank_record(what, gen, r) for r in range(world_size)]
        return None if None in got else got


class GenerationMoved(Exception):
    """A newer generation was published while this one's world was forming."""
