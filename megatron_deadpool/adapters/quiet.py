"""Collective suppression while a promoted spare walks startup code alone.

Survivors keep their model objects across a rebuild, so they never re-run construction or
Megatron-LM's startup. A promoted spare does, and that code issues value-only collectives:
GPTModel's tied-embedding all-reduce, Megatron-LM's startup barriers and timestamp
all-reduces, the do_train/do_valid/do_test broadcast, ``timers.log`` gathers. Run alone they
would block forever, and every value they produce is either overwritten by the restore that
follows or only printed. So, while suppression is on, those collectives are local no-ops.

* Only the thread that started the suppressor is affected: the mirror thread and the
  watcher keep real collectives.
* Group creation (``new_group``) is untouched: every rank must still make the same calls.
* Import-time aliases of collectives (``megatron.core.timers.dist_all_gather_func``) are
  patched too: a patch of ``torch.distributed`` alone misses them.
"""

from __future__ import annotations

import sys
import threading

NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
         "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base", "barrier",
         "reduce", "all_gather_object", "broadcast_object_list")

# (module, attribute): module-level aliases bound to a collective at import time.
ALIASES = (("megatron.core.timers", "dist_all_gather_func"),)


class _DoneWork:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True


class CollectiveSuppressor:
    """Makes the collectives of one thread local no-ops while on (module docstring): a
    promoted spare's startup code runs alone."""

    def __init__(self):
        self._saved = {}
        self._aliases = {}
        self._thread = None
        self.calls = 0

    @property
    def active(self) -> bool:
        return self._thread is not None

    def _wrap(self, name: str, real):
        def quiet(*args, **kwargs):
            if threading.get_ident() != self._thread:
                return real(*args, **kwargs)
            self.calls += 1
            if name == "all_gather_object":
                # Construction gathers structure (e.g. optimizer param-group keys) that is
                # the same on every rank by construction; this rank's value stands in.
                object_list, obj = args[0], args[1]
                for i in range(len(object_list)):
                    object_list[i] = obj
                return None
            return _DoneWork() if kwargs.get("async_op") else None

        return quiet

    def start(self) -> None:
        import torch.distributed as dist

        if self.active:
            return
        self._thread = threading.get_ident()
        for n in NAMES:
            if hasattr(dist, n):
                real = getattr(dist, n)
                self._saved[n] = real
                setattr(dist, n, self._wrap(n, real))
        for mod_name, attr in ALIASES:
            mod = sys.modules.get(mod_name)
            if mod is not None and hasattr(mod, attr):
                real = getattr(mod, attr)
                self._aliases[(mod_name, attr)] = real
                setattr(mod, attr, self._wrap(attr, real))

    def stop(self) -> None:
        import torch.distributed as dist

        for n, fn in self._saved.items():
            setattr(dist, n, fn)
        for (mod_name, attr), fn in self._aliases.items():
            setattr(sys.modules[mod_name], attr, fn)
        self._saved.clear()
        self._aliases.clear()
        self._thread = None
