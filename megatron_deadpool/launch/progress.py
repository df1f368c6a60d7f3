"""Progress on long work: the launcher's ``out`` for the demo, soak and benches.

Every worker line goes to a log file. The terminal gets one line per iteration, made from
the progress record that the rank logging the loss prints (``PROGRESS_PREFIX`` + JSON,
``api.Deadpool.after_step``), and the launcher's own lines (injected faults, failures, new
generations) between them::

    iter 12/30 | loss 4.8123 | step 212 ms | mirror lag 35 ms
    [launch] injected kill on node 1 at iteration 12 (forward_backward)
    [launch] generation 1: ranks [2, 3] -> spares [8, 9] (detected in 0.031s)
    recovery (generation 1): ranks [2, 3] failed; restored iteration 11; 2.714 s on rank 7 ...
    iter 12/30 | loss 4.8123 | step 230 ms | mirror lag - | redo

The formatting functions are pure; :class:`Console` only routes lines.
"""

from __future__ import annotations

import io
import json
import sys
import threading
from typing import Dict, Optional

from ..base.vocabulary import RECOVERY_PHASES, Phase
from ..base.worker_env import PROGRESS_PREFIX

# Launcher lines shown on the terminal: the launcher's own, a node agent's, and a worker's
# one-line error (``error: ...``, the trainer's entry point).
_SHOWN = ("[launch] ", "[agent ")
# a rank's own recovery phases, in order (the decider's ``detect`` is not a rank's)
_PHASES = tuple(p.value for p in RECOVERY_PHASES if p is not Phase.DETECT)


def parse(line: str) -> Optional[dict]:
    """The progress record in one (prefixed) output line, or None."""
    i = line.find(PROGRESS_PREFIX)
    if i < 0:
        return None
    try:
        rec = json.loads(line[i + len(PROGRESS_PREFIX):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "iteration" in rec else None


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def format_iteration(rec: dict, total: Optional[int] = None, redo: bool = False) -> str:
    """``iter 12/30 | loss 4.8123 | step 212 ms | mirror lag 35 ms``. ``mirror lag``: how
    long after the previous step the snapshot of its state was committed (``off``: no
    mirror); ``waited``: the part of this step spent waiting for that snapshot;
    ``UNPROTECTED``: the reporting rank's newest committed iteration lags too far behind."""
    it = rec["iteration"]
    width = len(str(total)) if total else 0
    head = f"iter {it:>{width}}/{total}" if total else f"iter {it}"
    loss = rec.get("loss")
    parts = [head, "loss -" if loss is None else f"loss {loss:.4f}",
             f"step {_ms(rec.get('step_s'))}"]
    if rec.get("generation") is None:
        parts.append("mirror off")
    else:
        lag = f"mirror lag {_ms(rec.get('mirror_lag_s'))}"
        waited = rec.get("mirror_wait_s") or 0.0
        if waited >= 0.0005:
            lag += f" (waited {_ms(waited)})"
        parts.append(lag)
    if rec.get("unprotected"):  # recovery/alarms.py: UNPROTECTED_LAG
        parts.append(f"UNPROTECTED (newest committed iteration {rec.get('committed')})")
    if redo:
        parts.append("redo")
    return " | ".join(parts)


def format_recovery(rec: dict) -> str:
    """The worker's view of a recovery that ended with this record's step: what it restored
    and how long each phase took on the reporting rank (detection: the launcher's line)."""
    r = rec["recovery"]
    phases = r.get("phases_s") or {}
    total = sum(v for v in phases.values() if v is not None)
    detail = " | ".join(f"{p} {phases[p]:.3f}" for p in _PHASES if phases.get(p) is not None)
    failed = r.get("failed_ranks")
    return (f"recovery (generation {r.get('generation')}): ranks {failed} failed; restored "
            f"iteration {r.get('restored_iter')}; {total:.3f} s on rank {rec.get('rank')} "
            f"({detail})")


def shown(line: str) -> bool:
    """A non-progress line worth a terminal line (launcher events, one-line errors)."""
    if line.startswith(_SHOWN):
        return True
    body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
    return body.startswith("error: ")


class Progress:
    """Turns output lines into terminal lines (pure: returns them). ``every``: show every
    N-th iteration only (plus the last, redone ones and recoveries); ``label`` leads each
    iteration line."""

    def __init__(self, total: Optional[int] = None, every: int = 1, label: str = ""):
        self.total, self.every, self.label = total, max(1, every), label
        self.newest = 0
        self.iterations = 0  # progress records seen

    def lines(self, line: str) -> list:
        rec = parse(line)
        if rec is None:
            return [line] if shown(line) else []
        self.iterations += 1
        it = rec["iteration"]
        redo = it <= self.newest
        self.newest = max(self.newest, it)
        out = [format_recovery(rec)] if rec.get("recovery") else []
        if redo or it % self.every == 0 or it == self.total or rec.get("recovery"):
            out.append(self.label + format_iteration(rec, self.total, redo))
        return out


class Console(io.TextIOBase):
    """The launcher's ``out``: every line is appended to ``log_path``; the terminal
    (``stream``, default stdout) gets :class:`Progress`'s lines, or every line with
    ``verbose``. Thread-safe (node agents write from their reader threads)."""

    def __init__(self, log_path: str, total: Optional[int] = None, every: int = 1,
                 label: str = "", verbose: bool = False, stream=None):
        self.log_path = log_path
        self.progress = Progress(total, every, label)
        self.verbose, self.stream = verbose, stream
        self._f = open(log_path, "a")
        self._lock = threading.Lock()
        self._bufs: Dict[int, str] = {}  # per writing thread: print() writes text, then "\n"

    def write(self, s: str) -> int:
        with self._lock:
            if self._f.closed:  # a late line after the command closed the log
                return len(s)
            self._f.write(s)
            key = threading.get_ident()
            buf = self._bufs.get(key, "") + s
            *done, self._bufs[key] = buf.split("\n")
            term = self.stream or sys.stdout
            for line in done:
                for shown_line in ([line] if self.verbose else self.progress.lines(line)):
                    term.write(shown_line + "\n")
            if done:
                self._f.flush()
                term.flush()
        return len(s)

    def flush(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()
        super().close()
