"""Worker entry point for ``deadpool launch --script``: prepares the process, then runs the
script as ``__main__`` in this same interpreter.

    python -m megatron_deadpool.launch.child [--device cpu|cuda] SCRIPT [script flags...]

* The script's folder goes first on ``sys.path``, so a Megatron-LM tree's own ``megatron``
  package wins over an installed ``megatron-core`` (``megatron`` is a namespace package).
* ``--device cpu`` switches the package's CPU mode on before Megatron builds anything, with
  one intra-op thread and deterministic algorithms, so runs are bitwise reproducible.
* Under ``deadpool launch`` (``DEADPOOL_RESULTS_DIR`` set), after the script returns,
  ``lm.finish()`` writes this rank's state fingerprint and results, as the reference trainer
  does, for the patched script and for an unpatched one alike.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    device = None
    if argv[:1] == ["--device"]:
        device, argv = argv[1], argv[2:]
    if not argv:
        raise SystemExit("usage: python -m megatron_deadpool.launch.child "
                         "[--device cpu|cuda] SCRIPT [flags...]")
    from ..membership import startup
    from ..base.worker_env import dump_stacks_on_crash, exit_with_launcher, log_to_stdout

    dump_stacks_on_crash()
    exit_with_launcher()  # a launcher killed outright leaves no orphans
    log_to_stdout()
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))
    startup.keep_usage_errors()  # Megatron-LM's parser: a bad flag is named, not "exit 2"
    try:
        lm = _prepare(device)
    except BaseException as exc:
        startup.report(exc)  # e.g. a dependency of Megatron-LM is missing
        raise
    from ..base.errors import DeadpoolError, JobStopped

    sys.argv = [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:
        lm.shutdown(exc)  # once joined, the runtime reports it
        if not lm.joined():  # before: the script's imports, its flags
            startup.report(exc)
        if isinstance(exc, DeadpoolError):  # a refused configuration, a stopped job: one line
            print(f"deadpool: error: {exc}", file=sys.stderr, flush=True)
            if isinstance(exc, JobStopped):
                _exit_now(2)
            raise SystemExit(2) from None
        raise
    if lm.results_dir():
        lm.finish()


def _prepare(device: Optional[str]):
    """CPU mode, Megatron-LM's training module and the package's hooks into it; returns
    ``megatron.lm``."""
    if device == "cpu":
        import torch

        from ..adapters import cpu_mode

        cpu_mode.enable()
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        from ..adapters import async_saves

        async_saves.cpu_writer()  # --async-save's writer process: the CPU layer on too
    from ..adapters import ft_package
    from ..megatron import lm

    lm.capture_setup()
    ft_package.hand_to_launcher()  # under ft_launcher: NVRx's client is deadpool launch
    return lm


def _exit_now(code: int) -> None:
    """The job stopped (its fallback copies, if any, are written and fsynced): exit without
    the interpreter's teardown, which took the stopped ranks 3.5-12 s under load before the
    launcher could exit and a restarter (ft_launcher, a Slurm requeue) start the next run.
    This process's own children (Megatron-LM's save helpers) are killed first."""
    import logging
    import multiprocessing

    logging.shutdown()
    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

