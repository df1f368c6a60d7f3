"""Collective suppression while a promoted spare builds its model and optimizer.

Survivors keep their model objects across a rebuild, so they never re-run construction.
Megatron's constructors do issue a few value-only collectives (e.g. GPTModel's tied-embedding
all-reduce between the first and last pipeline stage). If the spare ran them alone it would
block forever, and every value they produce is overwritten by the restore that follows.
So, between ``initialize_model_parallel`` and ``attach`` on a promoted spare, those
collectives are local no-ops. Group creation (``new_group``) is untouched.
"""

from __future__ import annotations

NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
         "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base", "barrier",
         "reduce", "all_gather_object", "broadcast_object_list")


class _DoneWork:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True


def _noop(*args, **kwargs):
    return _DoneWork() if kwargs.get("async_op") else None


class CollectiveSuppressor:
    def __init__(self):
        self._saved = {}
        self.calls = 0

    def start(self) -> None:
        import torch.distributed as dist

        def counted(*a, **k):
            self.calls += 1
            return _noop(*a, **k)

        def all_gather_object(object_list, obj, group=None):
            # Construction gathers structure (e.g. optimizer param-group keys) that is the
            # same on every rank by construction; the spare's own value stands in for all.
            self.calls += 1
            for i in range(len(object_list)):
                object_list[i] = obj

        for n in NAMES:
            if hasattr(dist, n):
                self._saved[n] = getattr(dist, n)
                setattr(dist, n, all_gather_object if n == "all_gather_object" else counted)

    def stop(self) -> None:
        import torch.distributed as dist

        for n, fn in self._saved.items():
            setattr(dist, n, fn)
        self._saved.clear()
