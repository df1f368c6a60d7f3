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


class GenerationMoved(Exception):
    """A newer generation was published while this one's world was forming."""


def arrive(store, gen: int, world_size: int, timeout_s: float, stop=lambda: None,
           poll_s: float = 0.2) -> None:
    """Abortable rendezvous before a generation's world is built: returns once all
    ``world_size`` members of generation ``gen`` arrived; raises GenerationMoved as soon as a
    newer generation exists (a member died meanwhile: nobody waits out a timeout for it).
    ``stop()`` may raise to abandon the wait (the job is shutting down). One counter and one
    "all here" key per generation: O(1) store operations per member and poll."""
    from datetime import timedelta

    done = k("arrived", gen, "all")
    if store.add(k("arrived", gen), 1) == world_size:
        store.set(done, "1")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait([done], timedelta(seconds=poll_s))
            return
        except Exception:  # noqa: BLE001 - a wait timeout: check why we are still waiting
            pass
        if current_gen(store) > gen:
            raise GenerationMoved(f"generation {current_gen(store)} replaced {gen}")
        stop()
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {gen}: only {store.add(k('arrived', gen), 0)} of "
                               f"{world_size} members arrived in {timeout_s:.0f}s")
