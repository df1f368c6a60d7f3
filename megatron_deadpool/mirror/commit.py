"""When a snapshot counts as committed: every rank has copied, sent and verified it.

Two ways to know it, chosen once per attach (``Protected.attach``):

* **collective** (the default; always during recovery): the snapshot job ends with the
  transport's ``all_ok``, an AND over the world.
* **implicit**: the training step already makes every rank wait for every other. With
  megatron-core's distributed optimizer, ``optimizer.step`` all-reduces the gradient norm
  over the whole world (``grad_stats_parallel_group``), and each rank enters that step only
  after waiting for its own snapshot job. So once step n has returned on this rank, every
  rank has finished every job before n, and the newest verified one is committed, with no
  collective of its own::

      rank a:  job k ── wait ── step k+1 [grad-norm all-reduce] ── begin k+1: commit k
      rank b:  job k ──── wait ── step k+1 [      ...          ] ── begin k+1: commit k

  Until then k-1 stays intact everywhere: no rank starts job k+1 (which overwrites k-1's
  slot) before that all-reduce. A copy that failed its verify is never held (``recv_iter``
  stays -1, so no restore uses it) and its holder does not commit that iteration.
"""

from __future__ import annotations

from typing import Optional


class CommitTracker:
    def __init__(self):
        self.implicit = False
        self.committed = -1
        self.failed = 0  # iterations whose copies did not all verify here (or anywhere)
        self._verified: Optional[int] = None  # implicit: done here, not yet proven elsewhere

    def collective(self, iteration: int, all_ok: bool) -> bool:
        """The world's vote on ``iteration``; True if it committed."""
        if all_ok:
            self.committed = iteration
        else:
            self.failed += 1
        return all_ok

    def verified(self, iteration: int, ok: bool) -> None:
        """Implicit: this rank finished job ``iteration`` (``ok``: every copy it received
        verified); it commits once a later step has returned (``settle``)."""
        self._verified = iteration if ok else None
        if not ok:
            self.failed += 1

    def settle(self, step: int) -> Optional[int]:
        """Implicit: optimizer step ``step`` has returned on this rank. Returns the iteration
        that committed now, if any."""
        it = self._verified
        if it is None or it >= step:
            return None
        self._verified = None
        self.committed = it
        return it

    def reset(self, iteration: int) -> None:
        """After a restore: ``iteration`` is committed, nothing else is pending."""
        self.committed, self._verified = iteration, None
