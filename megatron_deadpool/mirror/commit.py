"""When a snapshot counts as committed: every rank has copied, sent and verified it.

Two ways to know it, chosen once per attach (``Attachment.attach``):

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

  Nor does anyone else: only the holder sees its verify fail, so it posts the iteration on
  a :class:`RejectionBoard` (one key in the generation's store) before its job ends, and
  every rank checks that key when it settles the iteration. By the argument above the post
  is there by then (a rank settles k after step k+1 returned, which the holder entered only
  after its job k ended), so every rank agrees on ``committed`` as with the collective,
  with no collective of its own: one store ``check`` per snapshot job, on the mirror thread.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..membership import auth

log = logging.getLogger(__name__)

REJECTED_KEY = "deadpool-mirror-rejected/"


class RejectionBoard:
    """Implicit commits' one cross-rank signal, written only on failure: the iterations of
    which some holder rejected a copy. ``store``: the generation's (world.py prefixes it per
    generation, so a redone iteration after a recovery starts clean). A post is sealed with
    the job secret for its generation and iteration (``membership/auth.py``); one that does
    not verify is a forger's (someone without the secret), logged and ignored: it cannot
    keep an iteration from committing."""

    def __init__(self, store, secret: Optional[str] = None, gen: int = 0):
        self.store, self.secret, self.gen = store, secret or "", gen

    def post(self, iteration: int) -> None:
        self.store.set(f"{REJECTED_KEY}{iteration}", auth.seal(self.secret, {
            "k": "rejected", "g": self.gen, "it": iteration}))

    def posted(self, iteration: int) -> bool:
        key = f"{REJECTED_KEY}{iteration}"
        if not self.store.check([key]):
            return False
        try:
            auth.open_(self.secret, self.store.get(key), k="rejected", g=self.gen, it=iteration)
        except auth.AuthError as exc:
            log.warning("mirror commit of iteration %d: a rejection record forged by someone "
                        "without the job secret (%s): ignored", iteration, exc)
            return False
        return True


class CommitTracker:
    def __init__(self, implicit: bool = False):
        self.implicit = implicit
        self.committed = -1
        self.failed = 0  # iterations whose copies did not all verify here (or anywhere)
        self._verified: Optional[int] = None  # implicit: done here, not yet proven elsewhere
        self.board: Optional[RejectionBoard] = None  # implicit: rejections made elsewhere

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

    def rejected(self, iteration: int) -> None:
        """A copy of ``iteration`` failed its check here: posted for every rank's ``settle``
        (the collective commit needs no post: its vote carries it)."""
        if self.board is not None:
            self.board.post(iteration)

    def settle(self, step: int) -> Optional[int]:
        """Implicit: optimizer step ``step`` has returned on this rank. Returns the iteration
        that committed now, if any: not one that a holder anywhere rejected (the board)."""
        it = self._verified
        if it is None or it >= step:
            return None
        self._verified = None
        if self.board is not None and self.board.posted(it):
            self.failed += 1
            return None
        self.committed = it
        return it

    def reset(self, iteration: int) -> None:
        """After a restore: ``iteration`` is committed, nothing else is pending."""
        self.committed, self._verified = iteration, None
