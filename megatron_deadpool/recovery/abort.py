"""Abort every communicator of the current generation so that no thread stays blocked on a
dead or hung peer.

* NCCL (production): ``ProcessGroup.abort()`` on every group, **concurrently** (one hung
  group can block a serial abort), with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` set so the
  failure surfaces as an exception instead of killing the process.
* gloo: ``abort()`` does not free a thread blocked on a peer, and an old group keeps its
  sockets open while referenced. We therefore shut down (``shutdown(SHUT_RDWR)``) the
  established TCP connections of the communicators being aborted. Every pending gloo
  operation of this process then fails at once, and so do the peers' operations that wait
  on this process: the abort cascades through the job within milliseconds.

Which connections are the communicators': those that appeared while this process built them.
Every group DeadPool creates is built inside :func:`communicator_sockets` (``World``'s
``init_process_group`` and ``build_groups``, the mirror's gloo group), and gloo connects a
group's full mesh before its constructor returns, so the sockets that exist after the block
and not before it are that group's pairs. They are recorded by socket inode (``socket:[N]``
in /proc/self/fd), not by descriptor number, which a later socket may reuse. Everything else
survives an abort: the coordinator store's connections (also excluded by port) except the
generation's own one (``generation_store``), listening
sockets, a metrics client, a remote data reader, and NCCL's bootstrap and proxy sockets
(without a ``device_id``, as here, NCCL connects lazily, at a communicator's first
collective, outside any block; its communicators are aborted by ``abort()``). Limits: a socket that another thread of this
process opens during a group's creation is taken for the group's; a gloo group built with
``TORCH_GLOO_LAZY_INIT=1`` connects later and is not recorded: DeadPool sets it for a
recovery's default group only (world.py ``lazy_default``), which nothing uses while a peer
may die; its pairs are closed when the reaper destroys it. The mirror's own TCP connections are its transport's to shut (``World.on_abort``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import traceback
from typing import Dict, Iterable, List, Optional, Set

from ..adapters import groups

_owned: Set[int] = set()  # inodes of the sockets that this process's communicators opened
_owned_lock = threading.Lock()


def socket_inodes() -> Dict[int, int]:
    """``{inode: fd}`` of this process's sockets (Linux /proc; empty elsewhere)."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[len("socket:["):-1])] = int(name)
    return out


@contextlib.contextmanager
def communicator_sockets():
    """Build communicators inside this block: the sockets that appear in it are theirs, the
    ones a later abort shuts down (see the module docstring). Recorded even if the block
    fails (a half-built group's pairs are the abort's too)."""
    before = set(socket_inodes())
    try:
        yield
    finally:
        now = set(socket_inodes())
        with _owned_lock:
            _owned.intersection_update(now)  # closed ones: their inodes are free again
            _owned.update(now - before)


def owned_socket_inodes() -> Set[int]:
    with _owned_lock:
        return set(_owned)


_gen_store: Set[int] = set()  # inodes of the live generation's own store connection


def generation_store(store):
    """A connection of its own to the coordinator's TCPStore for one generation's
    communicators (``init_process_group`` and every ``new_group``), which the abort shuts
    down with them: a group's creation waits in a store ``get`` for each member's address,
    and a member that died meanwhile never writes it (``cascade_in_rebuild_groups`` waited
    out the regroup bound, 17 s). The coordinator's own connections stay (excluded by port).
    Any other store (a FileStore in tests) is returned as it is."""
    import torch.distributed as dist

    if not isinstance(store, dist.TCPStore):
        return store
    return _tracked_client(store.host, store.port, store.timeout, fresh=True)


def record_store_client(host: str, port: int, timeout):
    """A connection of this generation to a node's record store (recovery/world.py
    ``record_stores``), which the abort shuts down with the generation's store connection:
    a round waiting on it ends at the abort."""
    return _tracked_client(host, port, timeout, fresh=False)


def _tracked_client(host: str, port: int, timeout, fresh: bool):
    """A TCPStore client whose connection the abort shuts down with the generation's
    (``fresh``: the first of a generation, which forgets the last generation's)."""
    import torch.distributed as dist

    before = set(socket_inodes())
    client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                           timeout=timeout)
    with _owned_lock:
        if fresh:
            _gen_store.clear()
        _gen_store.update(set(socket_inodes()) - before)
    return client


def _ports(fd: int) -> Optional[tuple]:
    """(local port, remote port) of a connected TCP socket ``fd``; None for anything else
    (not a socket, another family, listening or unconnected)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        return s.getsockname()[1], s.getpeername()[1]
    except OSError:  # ENOTCONN: a listening or unconnected socket
        return None
    finally:
        s.close()


def comm_socket_fds(keep_ports: Iterable[int], owned: Iterable[int]) -> List[int]:
    """File descriptors of this process's connected TCP sockets whose inode is in ``owned``
    (the communicators', :func:`communicator_sockets`) and whose local and remote ports are
    not in ``keep_ports`` (the coordinator store's port). Only this process's own
    descriptors are inspected: the cost grows with its connections, not the machine's."""
    keep: Set[int] = set(keep_ports)
    fds = []
    for inode, fd in socket_inodes().items():
        if inode not in owned:
            continue
        ports = _ports(fd)
        if ports is None or ports[0] in keep or ports[1] in keep:
            continue
        fds.append(fd)
    return sorted(fds)


def shutdown_gloo_connections(store_port: int, only: Optional[Set[int]] = None,
                              with_store: bool = True) -> int:
    """Shut down the communicators' TCP connections in this process (``only``: those of
    these inodes, the groups that will not be kept: repair.py), and (``with_store``) the
    generation's store connection. Returns how many."""
    n = 0
    with _owned_lock:
        store_fds = [fd for inode, fd in socket_inodes().items()
                     if inode in _gen_store and with_store]
    owned = owned_socket_inodes() if only is None else owned_socket_inodes() & set(only)
    for fd in comm_socket_fds([store_port], owned) + store_fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()
    return n


def abort_nccl_groups(groups: Iterable, timeout_s: float = 30.0) -> List[str]:
    """Abort NCCL communicators concurrently. Returns errors (as strings) that abort raised."""
    errors: List[str] = []
    lock = threading.Lock()

    def _abort(pg):
        try:
            if hasattr(pg, "abort"):
                pg.abort()
            else:  # older torch
                from torch.distributed import distributed_c10d as c10d

                c10d._abort_process_group(pg)
        except Exception as exc:  # noqa: BLE001 - collected and reported, never swallowed
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=_abort, args=(pg,), daemon=True) for pg in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        errors.append(f"{sum(t.is_alive() for t in threads)} group abort(s) still running "
                      f"after {timeout_s}s")
    return errors


def all_process_groups() -> list:
    """Every group torch.distributed knows of in this process (default group included)."""
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_initialized():
        return []
    return list(c10d._world.pg_map.keys())


def abort_communicators(backend: str, store_port: Optional[int],
                        only: Optional[Set[int]] = None) -> dict:
    """Abort all communicators of this process for the given backend (``only``: on gloo,
    shut down only the connections of these socket inodes)."""
    info = {"backend": backend}
    if backend == "nccl":
        info["errors"] = abort_nccl_groups(all_process_groups())
    if store_port is not None:
        # gloo groups exist under NCCL too (megatron's *_GLOO groups, the mirror group).
        info["gloo_connections_shut"] = shutdown_gloo_connections(store_port, only)
    return info


def destroy_world(aborted: bool = False) -> None:
    """Forget this generation's groups: megatron's globals first, then torch's registry.

    ``aborted`` (the communicators were aborted by a recovery): where any group is NCCL,
    the registry is cleared through ``_abort_process_group`` instead of
    ``destroy_process_group``, whose shutdown of an aborted NCCL communicator waited for
    the dead peer and never returned (seen on an H200, NCCL 2.28.9, torch 2.11: every
    survivor stuck in ``destroy_process_group`` until fenced, docs/data/gpu_swap_h200_*)."""
    import torch.distributed as dist

    groups.destroy()
    if not dist.is_initialized():
        return
    if aborted and has_nccl_group():
        from torch.distributed import distributed_c10d as c10d

        c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def has_nccl_group() -> bool:
    """Some group torch.distributed knows of in this process runs on NCCL."""
    import torch.distributed as dist

    for pg in all_process_groups():
        try:
            if "nccl" in str(dist.get_backend(pg)).lower():
                return True
        except (RuntimeError, ValueError):
            continue
    return False


def drop_traceback(exc: BaseException) -> None:
    """The failed step's frames hold the old groups (schedules, p2p communicators): clear
    them so the old generation can be freed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__context__ or exc.__cause__
