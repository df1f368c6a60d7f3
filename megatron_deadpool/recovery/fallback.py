"""One worker's last-resort persistence (``--deadpool-fallback-save DIR``,
``--deadpool-fallback-every N``; the files: mirror/persist.py): what its files are tied to,
the periodic save after a commit, and the save when the job stops."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..adapters.support import parallel_layout
from ..mirror import persist

log = logging.getLogger(__name__)


class Fallback:
    def __init__(self, root: Optional[str], every: int, job_id: int):
        self.root, self.every, self.job_id = root, every, job_id
        self.manifest: Optional[persist.Manifest] = None

    def attach(self, mirror, world_size: int) -> Optional[Callable[[int], None]]:
        """At attach (``world_size``: stable, a spare takes the dead rank's id): this run's
        manifest; returns the periodic save to run after each commit, or None."""
        if not self.root:
            return None
        self.manifest = persist.Manifest(self.job_id, _run_id(),
                                         *parallel_layout(world_size))
        if not self.every:
            return None
        return lambda it: persist.periodic(mirror, self.root, self.every, self.manifest, it)

    def save(self, mirror, quiesce_s: float) -> list:
        """The job stops and memory cannot carry it on: once the mirror thread is idle (the
        communicators are aborted), write every copy this process holds. Returns
        [(rank, iteration, bytes written)]."""
        if not self.root or mirror is None or self.manifest is None:
            return []
        if not mirror.quiesce(quiesce_s):
            log.warning("fallback save: the mirror thread is still busy; saving what is sealed")
        return persist.save_held(mirror, self.root, self.manifest)


def _run_id() -> str:
    from torch.distributed import distributed_c10d as c10d

    import os

    from ..membership import auth

    # a run without a job secret (no launcher gave one): the run id's form is checked
    has = os.environ.get("DEADPOOL_TOKEN") or os.environ.get("DEADPOOL_TOKEN_FILE")
    secret = auth.load_secret() if has else None
    # the generation's store: prefixes of the launch's
    return persist.run_id(c10d._get_default_store(), secret)
