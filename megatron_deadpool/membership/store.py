"""Coordinator store: key names, connection with the job token, and the event queue.

One TCPStore, hosted by the launcher agent of node 0 (the node that runs the batch step: if
it dies, Slurm ends the job anyway, so the coordinator adds no failure domain). Keys::

    dp/token                 the job token (only the host writes it)
    dp/join/{lid}            a process asks to join (value: its token)
    dp/admit/{lid}           "ok" | "refused: ..."   (written by the decider)
    dp/gen                   current membership generation (only grows)
    dp/plan/{g}              JSON plan of generation g
    dp/hb/{lid}              JSON heartbeat {seq, iteration, committed, state}
    dp/events/n, dp/events/{i}   append-only event queue read by the decider
    dp/report/{g}/{rank}     a worker's recovery phase timings for generation g
    dp/shutdown              set once: the job is over (value: reason)
    gen{g}/...               torch.distributed rendezvous of generation g (PrefixStore)
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, List, Optional

from ..errors import TokenError

ROOT = "dp/"


def k(*parts: Any) -> str:
    return ROOT + "/".join(str(p) for p in parts)


def connect(host: str, port: int, timeout_s: float = 60.0, is_master: bool = False):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s))


def get_json(store, key: str) -> Any:
    return json.loads(store.get(key).decode())


def try_get(store, key: str) -> Optional[bytes]:
    if store.check([key]):
        return store.get(key)
    return None


def push_event(store, kind: str, **fields) -> None:
    i = store.add(k("events", "n"), 1)
    store.set(k("events", i), json.dumps({"kind": kind, "t": time.time(), **fields}))


def read_events(store, start: int) -> List[dict]:
    """Events with index > start (indices are 1-based)."""
    n = store.add(k("events", "n"), 0)
    out = []
    for i in range(start + 1, n + 1):
        key = k("events", i)
        store.wait([key], timedelta(seconds=10))
        out.append(json.loads(store.get(key).decode()))
    return out


def request_admission(store, lid: int, token: str, timeout_s: float) -> None:
    """Present the job token; the decider answers. Raises TokenError when refused."""
    store.set(k("join", lid), token)
    push_event(store, "join", lid=lid)
    key = k("admit", lid)
    store.wait([key], timedelta(seconds=timeout_s))
    answer = store.get(key).decode()
    if answer != "ok":
        raise TokenError(f"coordinator refused process {lid}: {answer}")


def current_gen(store) -> int:
    return int(store.add(k("gen"), 0))
