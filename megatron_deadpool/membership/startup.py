"""Startup errors. A process that fails before it attaches (a missing module, a bad flag, a
missing file) fails the same way on its peers and on every spare that would replace it: a
startup error, not a node failure. It tells the coordinator (a signed ``startup_error``
event) before it exits, and the decider stops the job with one line that names the
exception and the first rank that raised it, instead of spending the spares on it.

    before joining (imports, flag parsing):  the entry point calls report(exc)
                                             (reference trainer, launch/child.py)
    joined, not attached (the model build):  Runtime.report_fatal -> Member
    attached:                                a local error (FATAL) or a failure to recover

A process killed during startup (a signal, no report) is still a node failure.
"""

from __future__ import annotations

import argparse
import os
import traceback
from typing import Mapping

from .store import EventKind

CONNECT_TIMEOUT_S = 10.0  # the coordinator is up whenever a worker runs: this is a bound


def describe(exc: BaseException) -> str:
    """``ExcType: message`` in one line. argparse's exit (SystemExit 2) is described by the
    usage error it printed (``keep_usage_errors``), not by its exit code."""
    text = getattr(exc, "usage_error", None) or str(exc)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


def is_error(exc: BaseException) -> bool:
    """An exit that is a failure: not a clean SystemExit, not an interrupt, not the job's
    own stop (a standby spare released, a job stopped by another rank's error)."""
    from ..base.errors import JobStopped

    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    return not isinstance(exc, (KeyboardInterrupt, JobStopped))


def fields(exc: BaseException) -> dict:
    """The event's fields: the one-line description and the end of the traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"error": describe(exc)[:500], "traceback": text[-4000:]}


def report(exc: BaseException, environ: Mapping[str, str] = os.environ) -> None:
    """Tell the coordinator that this process, not yet joined, fails on ``exc``. Best
    effort and only under ``deadpool launch --deadpool`` (a coordinator store exists): a
    process that cannot reach it exits as before, and its exit is a failure like any."""
    if not is_error(exc):
        return
    from ..base.worker_env import WorkerEnv

    try:
        env = WorkerEnv.from_env(environ)
        if not env.store_port:
            return  # launched without --deadpool: no coordinator
        from . import auth
        from . import store as st

        coord = st.Coordinator(st.connect(env.store_host, env.store_port, CONNECT_TIMEOUT_S),
                               auth.load_secret(environ))
        coord.push_event(EventKind.STARTUP_ERROR, lid=env.lid, rank=env.rank, **fields(exc))
    except Exception:  # noqa: BLE001 - no coordinator to tell (or torch itself is missing)
        pass


def keep_usage_errors() -> None:
    """argparse reports a bad flag by printing it and exiting (SystemExit 2): keep the
    message on the exit, so that the startup error names the flag. For a script whose own
    parser runs in this process (``launch/child.py``: Megatron-LM's)."""
    original = argparse.ArgumentParser.error
    if getattr(original, "keeps_usage_errors", False):
        return

    def error(self, message):
        try:
            original(self, message)
        except SystemExit as exc:
            exc.usage_error = f"{self.prog}: error: {message}"
            raise

    error.keeps_usage_errors = True
    argparse.ArgumentParser.error = error
