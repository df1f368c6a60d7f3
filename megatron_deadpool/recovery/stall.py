"""A stalled recovery leaves evidence: when a newer generation has been published for
``after_s`` and this process has still not taken its plan (its main thread is blocked
somewhere the abort did not reach), write every thread's Python stack to stderr, once per
generation. The watcher thread calls ``observe`` on each poll; the agent forwards stderr to
the job log, so a rendezvous that later times out names where the missing member was.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import time
from typing import Optional

log = logging.getLogger(__name__)


class StallWatch:
    def __init__(self, after_s: float, clock=time.monotonic, dump=None):
        self.after_s, self.clock = after_s, clock
        self.dump = dump or (lambda: faulthandler.dump_traceback(sys.stderr, all_threads=True))
        self._seen: Optional[tuple] = None   # (generation, first seen)
        self._dumped = -1

    def observe(self, current_gen: int, own_gen: Optional[int]) -> bool:
        """True when this call dumped the stacks."""
        if own_gen is None or current_gen <= own_gen:
            self._seen = None
            return False
        if self._seen is None or self._seen[0] != current_gen:
            self._seen = (current_gen, self.clock())
            return False
        waited = self.clock() - self._seen[1]
        if current_gen == self._dumped or waited < self.after_s:
            return False
        self._dumped = current_gen
        log.warning("generation %s was published %.0fs ago and this process is still in "
                    "generation %s: its thread stacks follow", current_gen, waited, own_gen)
        self.dump()
        return True
