"""A planned swap's state straight from the draining rank (membership/drain.py), beside the
buddy's copy: ``--deadpool-drain-source direct``. The default stays ``buddy``, which
measured as fast or faster here (docs/planned-swaps.md).

    draining process, rank r of generation g          the spare taking rank r in g+1
    at the agreed boundary D, snapshot D sealed
    in its own slot: a sender thread               restore_state: a listener, published
    connects (the address sealed for g+1)    ──►   sealed for g+1; handshake (job secret)
    sends its own slot D                     ──►   received, verified (owner r, iteration,
                                                   layout, checksum), adopted as its own
    stays until g+1 has restored, then exits       restore: rank r holds D itself, so no
                                                   buddy sends it (recovery/restore.py)

It rides on the transport whose registry entry serves the hand-off (transport.py:
``handoff_transport``, the socket transport): a two-member transport per moved rank (0 the
draining process, 1 the spare) under its own store prefix.
The draining side sends on a thread of its own, so that it keeps watching for a newer plan
meanwhile (a failure during the drain makes it a member again: the sender is aborted). A handoff that fails on either side (a
timeout, a copy that does not verify) is logged, and the restore takes the buddy's copy as
with ``buddy``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..base.errors import TransportTimeout
from . import persist, snapshot
from .frames import PeerLost
from .transport import TransportContext, create_transport, handoff_transport

log = logging.getLogger(__name__)

DRAINING, SPARE = 0, 1
POLL_S = 0.01


def _store(default_store, gen: int, rank: int):
    """The handoff's namespace in the job's store, the same from both generations (the
    generation's default store is prefixed with it: world.py)."""
    import torch.distributed as dist

    base = default_store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    return dist.PrefixStore(f"handoff/g{gen}/r{rank}/", base)


def _transport(store, side: int, store_host: str, secret: str, gen: int, timeout_s: float):
    """One side (DRAINING or SPARE) of the hand-off's two-member transport, from the
    registry's entry that serves it: it only exchanges, so it takes no collectives; its
    listener is published on the route toward ``store_host``, as the mirror's is."""
    return create_transport(handoff_transport(), TransportContext(
        store, side, 2, None, store_host, secret, gen, timeout_s, purpose="handoff"))


class Sender:
    """The draining side: own slot ``iteration`` to the spare that takes ``rank`` in ``gen``,
    on a daemon thread. ``sent_bytes`` once done; ``error`` if it failed."""

    def __init__(self, mirror, default_store, store_host: str, secret: str, gen: int,
                 rank: int, iteration: int, timeout_s: float):
        self.sent_bytes: Optional[int] = None
        self.error: Optional[str] = None
        self._data = mirror.own.sealed(iteration)
        self._store, self._timeout_s, self._aborted = _store(default_store, gen, rank), \
            timeout_s, False
        self._t = _transport(self._store, DRAINING, store_host, secret, gen, timeout_s)
        self._thread = threading.Thread(target=self._run, name="deadpool-handoff",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._await_spare()
            self._t.exchange([(SPARE, self._data)], [])
            self.sent_bytes = self._data.numel()
        except Exception as exc:  # noqa: BLE001 - the spare falls back to the buddy's copy
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("drain handoff: the state was not sent straight to the spare (%s); "
                        "it takes the buddy's copy", self.error)
        finally:
            self._t.release()

    def _await_spare(self) -> None:
        """Until the spare's listener is published: short checks, not one long store wait,
        which would hold the store client that this process's other threads share, and
        which no abort could end."""
        deadline = time.monotonic() + self._timeout_s
        while not self._t.reachable(SPARE):
            if self._aborted:
                raise PeerLost("the drain was replaced by a newer plan")
            if time.monotonic() > deadline:
                raise TransportTimeout(f"the spare published no address in "
                                       f"{self._timeout_s:g}s")
            time.sleep(POLL_S)

    def abort(self) -> None:
        """A newer plan replaced the drain: stop sending."""
        self._aborted = True
        self._t.abort()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def receive(mirror, default_store, store_host: str, secret: str, gen: int, rank: int,
            timeout_s: float) -> Optional[int]:
    """The spare's side: the draining rank's slot, adopted as this rank's own. Returns its
    iteration, or None (logged): the restore then takes the buddy's copy."""
    layout = mirror.holdings.ensure_layout()
    buf = snapshot.alloc_slot(layout.total_bytes, mirror.pin)
    t = _transport(_store(default_store, gen, rank), SPARE, store_host, secret, gen, timeout_s)
    try:
        t.exchange([], [(DRAINING, buf)])
        iteration = snapshot.read_header(buf)["iteration"]
        persist.adopt(mirror, buf, iteration, mirror.job)  # verified before it is taken
    except Exception as exc:  # noqa: BLE001 - the buddy's copy is the fallback
        log.warning("drain handoff: rank %d took no state straight from the draining rank "
                    "(%s: %s); it takes the buddy's copy", rank, type(exc).__name__, exc)
        return None
    finally:
        t.release()
    return iteration
