"""Where this process's communicators do work that can grow with the world size, counted
into ``base/counts.py``: the groups it creates (and the calls it takes part in as a
non-member), the gloo connections they open, and the store operations of a generation's
store (``CountingStore``: gloo's rendezvous, the mirror's addresses).

A gloo group is connected eagerly, as a full mesh: a member opens a pair to each other
member (``size - 1`` connections), except a recovery's default group, which connects on
first use (world.py ``lazy_default``: no other group is lazy, and why). NCCL
connects lazily, on first use, so an NCCL group counts as created with no connections.
"""

from __future__ import annotations

from datetime import timedelta

from ..base import counts

_store_ops = False  # count_store_ops(): --deadpool-count-work


def count_store_ops() -> None:
    """Put each generation's store behind ``counting_store`` from now on. Opt-in: a store
    operation then passes through Python, and an error raised in it reaches torch's C++
    as a Python error."""
    global _store_ops
    _store_ops = True


_alive: list = []  # the counting stores handed to torch (KEEP generations' worth)
KEEP = 4


def generation_store(store):
    """``store``, counted when ``count_store_ops`` was called. torch's C++ calls the Python
    overrides through the object, so it is kept alive here (with no Python reference left
    the overrides are gone and ProcessGroupGloo fails: "Not implemented"); the last KEEP
    generations' are kept (an old generation's groups are destroyed on a reaper thread)."""
    if not _store_ops:
        return store
    counted = counting_store(store)
    _alive.append(counted)
    del _alive[:-KEEP]
    return counted


def main_connection(store):
    """The membership's main connection to the job's store (plan reads, the rendezvous and
    ready barriers, reports), its operations counted as ``control_store_ops`` (they land on
    the job's one store, apart from the groups' creation)."""
    return counted(store, "control_store_ops")


def counted(store, what: str = "record_store_ops"):
    """``store`` with its operations counted as ``what`` when ``count_store_ops`` was called
    (a node's record store by default: apart from the job's store, they land on another
    server); for Python callers only (nothing kept alive for torch's C++)."""
    return counting_store(store, what) if _store_ops else store


def count_group(backend: str, size: int, lazy: bool = False) -> None:
    """A group of ``size`` members this process belongs to was created (``lazy``: a gloo
    group that connects a pair on first use, none now)."""
    counts.add("groups_created")
    counts.add("group_members", size)
    if str(backend).lower() == "gloo" and not lazy:
        counts.add("connections", max(0, size - 1))


def install() -> None:
    """Count every ``torch.distributed.new_group`` call (both names megatron and this
    package call it by); idempotent."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    orig = c10d.new_group
    if getattr(orig, "_deadpool_counted", False):
        return

    def new_group(*args, **kwargs):
        group = orig(*args, **kwargs)
        counts.add("new_group_calls")
        if group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            try:
                count_group(dist.get_backend(group), dist.get_world_size(group))
            except (RuntimeError, ValueError):  # not usable here: nothing was connected
                pass
        return group

    new_group._deadpool_counted = True
    new_group.__wrapped__ = orig
    new_group.__name__, new_group.__doc__ = orig.__name__, orig.__doc__
    if dist.new_group is orig:
        dist.new_group = new_group
    c10d.new_group = new_group


def counting_store(store, what: str = "store_ops"):
    """``store`` behind a c10d Store that counts each operation (as ``what``); torch's
    gloo rendezvous calls it from C++ through the Python override."""
    import torch.distributed as dist

    class CountingStore(dist.Store):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def wait(self, keys, timeout=None):
            counts.add(what)
            if timeout is None:
                return self.inner.wait(keys)
            return self.inner.wait(keys, timeout if isinstance(timeout, timedelta)
                                   else timedelta(seconds=float(timeout)))

        def num_keys(self):
            return self.inner.num_keys()

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

    for name in COUNTED_OPS:  # torch's C++ finds an override by name, on the class
        setattr(CountingStore, name, _counted(name, what))
    return CountingStore(store)


COUNTED_OPS = ("set", "get", "add", "check", "compare_set", "delete_key")


def _counted(name: str, what: str):
    def op(self, *args):
        counts.add(what)
        return getattr(self.inner, name)(*args)
    op.__name__ = name
    return op
