"""Find every slot that holds a process group, remember its *role*, and rebind it after a
rebuild; then audit that no group of an old generation is reachable.

Roles are found by identity against megatron's ``parallel_state`` globals (plus the
default group ``WORLD``). The walk covers attributes (``__dict__`` and ``__slots__``),
dataclass fields, dicts, lists and tuples. A tuple cannot be patched in place: the tuple is
rebuilt and set back through its owner.

The walk runs once at attach time (milliseconds); it is *not* a ``gc.get_referrers`` scan,
which measured ~6 s across 8 processes. The optional full audit scans the heap and is meant
for tests and ``--deadpool-audit full``.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..adapters import groups
from ..base.config import Audit
from ..base.errors import RebindAuditError

# how long the full audit gives a thread finishing an old-generation call (an abandoned
# gloo wait unwinding) to let go of an old group before it counts as a leak
AUDIT_GRACE_S = 2.0

_ATOMIC = (str, bytes, int, float, bool, complex, type(None), types.FunctionType,
           types.BuiltinFunctionType, types.ModuleType, type, types.MethodType)


def _pg_type():
    import torch.distributed as dist

    return dist.ProcessGroup


def current_roles() -> Dict[int, str]:
    """id(group) -> role name, for the groups of the current generation."""
    import torch.distributed as dist

    roles = groups.roles(_pg_type())
    if dist.is_initialized():
        roles.setdefault(id(dist.group.WORLD), "WORLD")
    return roles


def group_for_role(role: str):
    import torch.distributed as dist

    if role == "WORLD":
        return dist.group.WORLD
    return groups.group_of(role)


# A path step: ("attr", name) | ("item", key) | ("index", i) | ("tuple", i)
Step = Tuple[str, Any]


@dataclass
class Slot:
    root_index: int
    path: Tuple[Step, ...]
    role: str

    def describe(self) -> str:
        return f"root{self.root_index}" + "".join(
            f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in self.path)


def _children(obj) -> Iterable[Tuple[Step, Any]]:
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield ("item", k), v
        return
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield ("index", i), v
        return
    if isinstance(obj, tuple):
        for i, v in enumerate(obj):
            yield ("tuple", i), v
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for k, v in list(d.items()):
            yield ("attr", k), v
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()) or ():
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                yield ("attr", name), getattr(obj, name)
            except AttributeError:
                continue


_WALK, _SKIP, _GROUP = 0, 1, 2
_KIND: Dict[type, int] = {}  # per type: the walk's decision (isinstance is the walk's cost)


def _kind(obj) -> int:
    """_GROUP for a process group, _SKIP for what the walk never enters (atoms, code,
    tensors), else _WALK; decided once per type."""
    t = type(obj)
    kind = _KIND.get(t)
    if kind is None:
        import torch

        if isinstance(obj, _pg_type()):
            kind = _GROUP
        elif isinstance(obj, _ATOMIC) or isinstance(obj, (torch.Tensor, torch.dtype,
                                                           torch.device, torch.Generator)):
            kind = _SKIP
        else:
            kind = _WALK
        _KIND[t] = kind
    return kind


def walk(roots: Sequence[Any]) -> List[Tuple[int, Tuple[Step, ...], Any]]:
    """All (root_index, path, group) reachable from ``roots`` without passing through
    tensors, modules of code, or functions."""
    found = []
    seen = set()
    for ri, root in enumerate(roots):
        stack = [(root, ())]
        while stack:
            obj, path = stack.pop()
            kind = _kind(obj)
            if kind == _GROUP:
                found.append((ri, path, obj))
                continue
            if kind == _SKIP or id(obj) in seen:
                continue
            seen.add(id(obj))
            for step, child in _children(obj):
                kind = _kind(child)
                if kind == _GROUP:
                    found.append((ri, path + (step,), child))
                elif kind == _WALK and id(child) not in seen:
                    stack.append((child, path + (step,)))
    return found


class GroupSlots:
    """The recorded slots of the attached objects."""

    def __init__(self, roots: Sequence[Any]):
        self.roots: List[Any] = []
        self.slots: List[Slot] = []
        self.unknown: List[str] = []
        self.add(roots)

    def add(self, roots: Sequence[Any]) -> None:
        """Walk more roots (holders found later, e.g. train()'s arguments) and record their
        slots; each is rebound and audited with the others."""
        first = len(self.roots)
        self.roots.extend(roots)
        roles = current_roles()
        for ri, path, group in walk(self.roots[first:]):
            role = roles.get(id(group))
            if role is None:
                self.unknown.append(Slot(first + ri, path, "?").describe())
                continue
            self.slots.append(Slot(first + ri, path, role))

    def __len__(self):
        return len(self.slots)

    def rebind(self) -> int:
        """Point every slot at the current generation's group of the same role."""
        for slot in self.slots:
            _set_path(self.roots[slot.root_index], slot.path, group_for_role(slot.role))
        return len(self.slots)

    def release(self) -> list:
        """Unset every slot (None) and return the distinct groups they held: the caller
        decides where their last references die (reaper.py)."""
        held, seen = [], set()
        for slot in self.slots:
            root = self.roots[slot.root_index]
            group = _get_path(root, slot.path)
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                held.append(group)
            _set_path(root, slot.path, None)
        return held

    def audit(self) -> None:
        """Fail if any reachable group is not one of the current generation's groups."""
        roles = current_roles()
        stale = [Slot(ri, p, "?").describe() for ri, p, g in walk(self.roots)
                 if id(g) not in roles]
        if stale:
            raise RebindAuditError(f"{len(stale)} slot(s) still hold an old process group: "
                                   + ", ".join(stale[:10]))


def _get_step(obj, step: Step):
    kind, key = step
    if kind == "attr":
        return getattr(obj, key)
    return obj[key]


def _get_path(root, path: Tuple[Step, ...]):
    for step in path:
        root = _get_step(root, step)
    return root


def _set_path(root, path: Tuple[Step, ...], value) -> None:
    """Set the object at ``path`` below ``root``; tuples on the way are rebuilt."""
    objs = [root]
    for step in path[:-1]:
        objs.append(_get_step(objs[-1], step))
    for i in range(len(path) - 1, -1, -1):
        parent, (kind, key) = objs[i], path[i]
        if kind == "attr":
            setattr(parent, key, value)
            return
        if kind in ("item", "index"):
            parent[key] = value
            return
        # tuple: rebuild it and continue upward with the new tuple as the value
        items = list(parent)
        items[key] = value
        value = type(parent)(*items) if hasattr(parent, "_fields") else tuple(items)
    raise RebindAuditError("a root object itself is a tuple holding a group: cannot rebind")


def weak_groups(groups: Iterable[Any]) -> List["weakref.ref"]:
    """Weak references to the given groups (taken before a rebuild)."""
    out, seen = [], set()
    for g in groups:
        if id(g) not in seen:
            seen.add(id(g))
            out.append(weakref.ref(g))
    return out


def heap_audit(old_groups: Sequence["weakref.ref"], grace_s: float = 0.0) -> List[str]:
    """After a rebuild: every old group must have been freed. For any survivor, name what
    still holds it: the types of the objects (a ``gc.get_referrers`` scan: slow, but it
    only runs when something leaked), and the running frames of other threads, whose
    locals the collector does not see. A group released by a thread still finishing an
    old-generation call (unwinding an abandoned wait) dies within ``grace_s``: it is looked
    at again until then. Returns an empty list when clean."""
    deadline = time.monotonic() + grace_s
    while True:
        gc.collect()
        alive = [ref for ref in old_groups if ref() is not None]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    leaks = []
    for ref in alive:
        g = ref()
        if g is None:
            continue
        holders = [type(o).__name__ for o in gc.get_referrers(g)
                   if not isinstance(o, (list,)) or o is not old_groups]
        holders += _running_frames_holding(g)
        leaks.append("group held by " + (", ".join(sorted(set(holders))) or "?"))
        del g
    return leaks


def _running_frames_holding(g) -> List[str]:
    """'thread NAME in FUNC (FILE:LINE)' for each frame of another thread whose locals
    hold ``g``, directly or in a tuple, list or dict among them."""
    names, out = {t.ident: t.name for t in threading.enumerate()}, []
    for ident, frame in sys._current_frames().items():
        while frame is not None and ident != threading.get_ident():
            values = [v for x in frame.f_locals.values() for v in (
                x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else (x,))]
            if any(v is g for v in values):
                out.append(f"thread {names.get(ident, ident)} in {frame.f_code.co_name} "
                           f"({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
            frame = frame.f_back
    return out


def audit_rebind(mode: Audit, slots: "GroupSlots", old_groups: Sequence["weakref.ref"],
                 settle=lambda: None) -> Optional[dict]:
    """After a rebuild (``--deadpool-audit``): 'walk' re-walks the slots, 'full' also scans
    the heap for a survivor of ``old_groups`` once ``settle()`` has let the released ones
    die. Raises RebindAuditError on a leak; returns the audit event's fields for 'full'."""
    if mode is Audit.NONE:
        return None
    slots.audit()
    if mode is not Audit.FULL:
        return None
    settle()
    leaks = heap_audit(old_groups, AUDIT_GRACE_S)
    if leaks:
        raise RebindAuditError(f"{len(leaks)} old process group(s) still alive after the "
                               f"rebuild: {leaks[:5]}")
    return {"mode": "full", "old_groups": len(old_groups), "leaked": 0}
