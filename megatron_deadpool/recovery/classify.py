"""Is an exception a peer failure (recover in place) or a local error (fail the job fast
with its own traceback)? Pure: a function of the exception and of whether this process's
communicators were aborted by the watcher.

    peer failure   the watcher aborted this generation's communicators (a new generation was
                   published, so whatever the main thread raised is a symptom of that), or
                   the exception is a communication failure: torch.distributed's DistError
                   family, a mirror transport error, or a gloo/NCCL/socket message below.
    local error    anything else: an OOM, non-finite gradients, a bug, a bad batch. One rank
                   reports it, the job stops, no spare is spent.
"""

from __future__ import annotations

import re

from ..base.errors import DeadpoolError, MirrorError
from ..membership.store import GenerationMoved

_COMM_PATTERNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Connection refused|Broken pipe|"
    r"Read error|Write error|Socket Timeout|Timed out waiting|"
    r"gloo/transport|\[gloo\]|NCCL error|NCCL communicator|ProcessGroupNCCL|ncclRemoteError|"
    r"ncclSystemError|Watchdog caught collective|communicator was aborted|"
    r"Connection to .* was closed|ECONNRESET|EPIPE", re.I)


def is_comm_failure(exc: BaseException) -> bool:
    """The exception (or one it was raised from) says a collective or a connection failed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (MirrorError, ConnectionError)):
            return True
        if type(exc).__name__ in ("DistError", "DistBackendError", "DistNetworkError",
                                  "DistStoreError"):
            return True
        if isinstance(exc, (RuntimeError, OSError)) and _COMM_PATTERNS.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_peer_failure(exc: BaseException, aborted: bool) -> bool:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return False
    return aborted or is_comm_failure(exc)


def failed_again(exc: BaseException, aborted: bool) -> bool:
    """A failure inside a recovery attempt that a newer generation may cure: not a stop, a
    stale generation or a lost state (DeadpoolErrors that are not mirror errors: terminal)."""
    if isinstance(exc, DeadpoolError) and not isinstance(exc, MirrorError):
        return False
    return aborted or is_comm_failure(exc) or isinstance(exc, GenerationMoved)
