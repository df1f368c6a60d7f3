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
    dp/failing/{g}                 a member of generation g was declared dead; its
                                   replacement plan may take a while (signed, gen)
    dp/arrived/{g}, .../all        abortable rendezvous before generation g's world forms
    dp/ready/{g}, .../all          abortable barrier before generation g's restore: every
                                   member, a promoted spare too, can receive (model built)
    dp/hb/{lid}, dp/agent_hb/{n}   worker and node-agent heartbeats (signed)
    dp/cmd/{node}/n, .../{i}       commands for a node agent (signed, node and i; CommandOp)
    dp/inject/{i}                  counter: the first process to reach fault i claims it
    dp/report/{g}/{rank}           a worker's recovery phase timings for generation g
    dp/boundary/{g}/{rank}         the iteration a rank stops at for planned generation g
    dp/shutdown                    set once: the job is over (signed reason)
    gen{g}/...                     torch.distributed rendezvous of generation g (PrefixStore)
"""

from __future__ import annotations

import enum
import json
import secrets
import socket
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..base.errors import TokenError
from . import auth
from .plan import Plan

ROOT = "dp/"


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

    fd = None
    if is_master:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        fd = sock.detach()
    return TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)


def get_json(store, key: str) -> Any:
    return json.loads(store.get(key).decode())


class Coordinator:
    """The store as job members use it: every message sealed with the job secret (see
    ``auth.py``) and opened only if it verifies for its slot. Forged, unsigned or misplaced
    (copied to another slot) messages are never acted on (events come back as kind
    "forged"); a genuine one written back to its own slot is left to its reader (``auth``)."""

    def __init__(self, store, secret: str):
        self.raw, self.secret = store, secret
        self._gen = 0

    # -------------------------------------------------------------- events
    def push_event(self, kind: str, **fields) -> None:
        i = self.raw.add(k("events", "n"), 1)
        self.raw.set(k("events", i), auth.seal(self.secret, {"i": i, "kind": kind,
                                                             "t": time.time(), **fields}))

    def read_events(self, start: int) -> List[dict]:
        """Events with index > start (1-based); a message that does not verify becomes
        {"kind": "forged", "claimed": <its unverified body>, "why": ...}."""
        n = self.raw.add(k("events", "n"), 0)
        out = []
        for i in range(start + 1, n + 1):
            key = k("events", i)
            self.raw.wait([key], timedelta(seconds=10))
            raw = self.raw.get(key)
            try:
                out.append(auth.open_(self.secret, raw, i=i))
            except auth.AuthError as exc:
                out.append({"kind": EventKind.FORGED, "i": i, "why": str(exc), "claimed": _peek(raw)})
        return out

    # -------------------------------------------------------------- plans
    def publish_plan(self, plan: Plan) -> None:
        g = plan.gen
        self.raw.set(k("plan", g), auth.seal(self.secret, plan.to_json()))
        self.raw.set(k("latest"), auth.seal(self.secret, {"gen": g}))

    def current_gen(self) -> int:
        """The newest generation with a valid signed pointer (a forged one is ignored)."""
        key = k("latest")
        if self.raw.check([key]):
            try:
                self._gen = max(self._gen, int(auth.open_(self.secret, self.raw.get(key))["gen"]))
            except (auth.AuthError, KeyError, TypeError, ValueError):
                pass
        return self._gen

    def declare_failing(self, gen: int) -> None:
        self.raw.set(k("failing", gen), auth.seal(self.secret, {"gen": gen}))

    def is_failing(self, gen: int) -> bool:
        key = k("failing", gen)
        if not self.raw.check([key]):
            return False
        try:
            return auth.open_(self.secret, self.raw.get(key), gen=gen)["gen"] == gen
        except (auth.AuthError, KeyError):
            return False

    def generation_done(self, plan: Plan) -> bool:
        """Every rank of ``plan`` reported its recovery's first step (generation 0: none)."""
        return plan.gen == 0 or self.raw.check([k("report", plan.gen, r) for r in range(plan.world_size)])

    def get_plan(self, gen: int) -> Plan:
        return Plan.from_json(auth.open_(self.secret, self.raw.get(k("plan", gen)), gen=gen))

    # -------------------------------------------------------------- admission
    def request_admission(self, lid: int, timeout_s: float) -> None:
        """Ask to join; the decider answers with a sealed admission for this request's
        nonce. Raises TokenError when refused or when the answer is not signed with this
        process's secret (a wrong DEADPOOL_TOKEN)."""
        nonce = secrets.token_hex(8)
        self.push_event(EventKind.JOIN, lid=lid, nonce=nonce)
        key = k("admit", lid, nonce)
        self.raw.wait([key], timedelta(seconds=timeout_s))
        try:
            body = auth.open_(self.secret, self.raw.get(key), lid=lid, nonce=nonce)
        except auth.AuthError:
            raise TokenError(f"coordinator refused process {lid}: the job secret does not "
                             "match (wrong DEADPOOL_TOKEN)") from None
        if not body.get("ok"):
            raise TokenError(f"coordinator refused process {lid}: {body.get('why')}")

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
        self.raw.set(k("spare_node", nonce), auth.seal(
            self.secret, {"nonce": nonce, "node": node, "lids": lids}))

    def request_drain(self, timeout_s: float, **fields) -> dict:
        """``deadpool drain`` (node, reason, to_standby, text): the decider's answer."""
        nonce = secrets.token_hex(8)
        self.push_event(EventKind.DRAIN_REQUEST, nonce=nonce, **fields)
        self.raw.wait([k("drain", nonce)], timedelta(seconds=timeout_s))
        return auth.open_(self.secret, self.raw.get(k("drain", nonce)), nonce=nonce)

    def answer_drain(self, nonce: str, body: dict) -> None:
        self.raw.set(k("drain", nonce), auth.seal(self.secret, {"nonce": nonce, **body}))

    def publish_job_env(self, env: Dict[str, str]) -> None:
        self.raw.set(k("job_env"), auth.seal(self.secret, {"env": env}))

    def job_env(self, timeout_s: float) -> Dict[str, str]:
        self.raw.wait([k("job_env")], timedelta(seconds=timeout_s))
        return auth.open_(self.secret, self.raw.get(k("job_env")))["env"]

    def answer_admission(self, lid: int, nonce: str, ok: bool, why: str = "") -> None:
        self.raw.set(k("admit", lid, nonce), auth.seal(
            self.secret, {"lid": lid, "nonce": nonce, "ok": ok, "why": why}))

    def refuse_forged_join(self, claimed: dict) -> None:
        """A join request that did not verify is refused, so its sender stops waiting."""
        lid, nonce = claimed.get("lid"), claimed.get("nonce")
        if claimed.get("kind") == EventKind.JOIN and isinstance(lid, int) and isinstance(nonce, str):
            self.answer_admission(lid, nonce, ok=False, why="wrong job secret")

    # -------------------------------------------------------------- shutdown
    def set_shutdown(self, reason: str) -> bool:
        if self.shutdown_reason() is not None:
            return False
        self.raw.set(k("shutdown"), auth.seal(self.secret, {"reason": reason}))
        return True

    def shutdown_reason(self) -> Optional[str]:
        key = k("shutdown")
        if not self.raw.check([key]):
            return None
        try:
            return auth.open_(self.secret, self.raw.get(key))["reason"]
        except (auth.AuthError, KeyError):
            return None

    # -------------------------------------------------------------- heartbeats
    def beat(self, lid: int, **fields) -> None:
        self.raw.set(k("hb", lid), auth.seal(self.secret, {"lid": lid, **fields}))

    def heartbeats(self, lids: Sequence[int]) -> Dict[int, dict]:
        present = [lid for lid in lids if self.raw.check([k("hb", lid)])]
        out = {}
        if present:
            for lid, raw in zip(present, self.raw.multi_get([k("hb", x) for x in present])):
                try:
                    out[lid] = auth.open_(self.secret, raw, lid=lid)
                except auth.AuthError:
                    continue
        return out

    def agent_beat(self, node: int, seq: int) -> None:
        self.raw.set(k("agent_hb", node), auth.seal(self.secret, {"node": node, "seq": seq}))

    def agent_heartbeat(self, node: int) -> Optional[int]:
        key = k("agent_hb", node)
        if not self.raw.check([key]):
            return None
        try:
            return int(auth.open_(self.secret, self.raw.get(key), node=node)["seq"])
        except (auth.AuthError, KeyError):
            return None

    # -------------------------------------------------------------- agent commands
    def push_command(self, node: int, cmd: dict) -> None:
        i = self.raw.add(k("cmd", node, "n"), 1)
        self.raw.set(k("cmd", node, i), auth.seal(self.secret, {**cmd, "node": node, "i": i}))

    def read_commands(self, node: int, start: int) -> Tuple[List[dict], int, int]:
        """(verified commands after ``start``, new cursor, how many were rejected)."""
        n = self.raw.add(k("cmd", node, "n"), 0)
        out, bad = [], 0
        for i in range(start + 1, n + 1):
            try:
                out.append(auth.open_(self.secret, self.raw.get(k("cmd", node, i)),
                                      node=node, i=i))
            except auth.AuthError:
                bad += 1
        return out, n, bad


def _peek(raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode()).get("body")
        return body if isinstance(body, dict) else {}
    except (ValueError, AttributeError, RecursionError):  # a forged record: nothing claimed
        return {}


class GenerationMoved(Exception):
    """A newer generation was published while this one's world was forming."""


def arrive(coord: "Coordinator", gen: int, world_size: int, timeout_s: float,
           stop=lambda: None, poll_s: float = 0.2, barrier: str = "arrived") -> None:
    """Abortable rendezvous before a generation's world is built: returns once all
    ``world_size`` members of generation ``gen`` arrived; raises GenerationMoved as soon as a
    newer generation exists (a member died meanwhile: nobody waits out a timeout for it).
    ``stop()`` may raise to abandon the wait (the job is shutting down). One counter and one
    "all here" key per generation: O(1) store operations per member and poll. ``barrier``
    names another barrier of the same generation (``ready``: every member can restore)."""
    from datetime import timedelta

    store = coord.raw
    done = k(barrier, gen, "all")
    if store.add(k(barrier, gen), 1) == world_size:
        store.set(done, "1")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait([done], timedelta(seconds=poll_s))
            return
        except Exception:  # noqa: BLE001 - a wait timeout: check why we are still waiting
            pass
        if coord.current_gen() > gen:
            raise GenerationMoved(f"generation {coord.current_gen()} replaced {gen}")
        stop()
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {gen}: only {store.add(k(barrier, gen), 0)} of "
                               f"{world_size} members {barrier} in {timeout_s:.0f}s")
