"""The common changes of docs/architecture.md ("Common changes"), made for real: each in a
temporary copy of the package, touching only the files the doc names, and shown to run there
(the copy's own code, on its own PYTHONPATH) and to pass the structure checks
(tests/test_structure.py, pointed at the copy by DEADPOOL_STRUCTURE_ROOT). A planted defect
(the change made without one of its files) fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def _copy(tmp_path: Path) -> Path:
    """A copy of the package and of docs/architecture.md (what the structure checks read)."""
    root = tmp_path / "copy"
    shutil.copytree(REPO / "megatron_deadpool", root / "megatron_deadpool",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "docs").mkdir(parents=True)
    shutil.copy(REPO / "docs" / "architecture.md", root / "docs" / "architecture.md")
    return root


def _run(root: Path, args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python ARGS`` on the copy: its package first on the path, the structure checks
    pointed at it."""
    env = dict(os.environ, PYTHONPATH=str(root), DEADPOOL_STRUCTURE_ROOT=str(root),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


# (b) a store-backed mirror transport: the backend module and one registry entry

KV_BACKEND = '''\
"""A toy transport: every message is one key of the generation's store."""

from __future__ import annotations

from datetime import timedelta

import torch

from .transport_api import MirrorTransport, count_messages


class KvTransport(MirrorTransport):
    kind = "kv"

    def __init__(self, store, rank: int, world_size: int, collectives, timeout_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.collectives, self.timeout_s = collectives, timeout_s
        self._seq = {}  # (direction, peer) -> messages so far

    def _key(self, src: int, dst: int, way: str) -> str:
        n = self._seq[(way, src, dst)] = self._seq.get((way, src, dst), -1) + 1
        return f"kv/{src}-{dst}/{n}"

    def exchange(self, sends, recvs, timeout_s=None) -> None:
        count_messages(sends, recvs)
        for dst, buf in sends:
            self.store.set(self._key(self.rank, dst, "out"), buf.numpy().tobytes())
        for src, buf in recvs:
            key = self._key(src, self.rank, "in")
            self.store.wait([key], timedelta(seconds=timeout_s or self.timeout_s))
            data = self.store.get(key)
            buf[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def all_ok(self, ok, timeout_s=None):
        return self.collectives.all_ok(ok, timeout_s)

    def all_gather_int(self, value, timeout_s=None):
        return self.collectives.all_gather_int(value, timeout_s)

    def all_gather_json(self, obj, timeout_s=None):
        return self.collectives.all_gather_json(obj, timeout_s)
'''

KV_ENTRY = '''

@register_transport("kv", "the generation's store, one key per message")
def _kv(ctx: TransportContext) -> "MirrorTransport":
    from .kv_transport import KvTransport

    return KvTransport(ctx.store, ctx.rank, ctx.world_size, ctx.collectives, ctx.timeout_s)
'''

# runs in the copy: the flag offers it, the settings take it, and three ranks (threads on
# one store) pass tests/test_transport.py's conformance exchange through create_transport
KV_RUN = textwrap.dedent(f'''
    import argparse, sys, threading
    import torch
    import megatron_deadpool
    from megatron_deadpool.base.config import DeadpoolConfig
    from megatron_deadpool.control.link import MirrorSettings
    from megatron_deadpool.flags import add_deadpool_args
    from megatron_deadpool.mirror.rounds import StoreRounds
    from megatron_deadpool.mirror.transport import TransportContext, create_transport
    assert megatron_deadpool.__file__.startswith(sys.argv[1]), megatron_deadpool.__file__
    sys.path.insert(0, {str(TESTS)!r})
    from test_transport import SECRET, WORLD, _conformance

    parser = add_deadpool_args(argparse.ArgumentParser())
    cfg = DeadpoolConfig.from_args(parser.parse_args(["--deadpool-mirror-transport", "kv"]))
    assert MirrorSettings(transport=cfg.mirror_transport).transport_name == "kv"
    flag = next(a for a in parser._actions if "--deadpool-mirror-transport" in a.option_strings)
    assert "kv" in flag.choices and "or 'kv', the generation's store, one key" in flag.help
    store, errors = torch.distributed.HashStore(), []

    def rank(r):
        try:
            rounds = StoreRounds(store, r, WORLD, timeout_s=30, secret=SECRET, gen=0)
            t = create_transport("kv", TransportContext(store, r, WORLD, rounds, timeout_s=30))
            assert t.kind == "kv"
            _conformance(t, r)
        except BaseException as exc:
            errors.append(f"rank {{r}}: {{type(exc).__name__}}: {{exc}}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    print("KV RAN")
''')


def _add_kv_transport(root: Path, entry: bool = True) -> None:
    """The change as docs/architecture.md (b) gives it: a backend module, one entry."""
    mirror = root / "megatron_deadpool" / "mirror"
    (mirror / "kv_transport.py").write_text(KV_BACKEND)
    if entry:
        with open(mirror / "transport.py", "a") as f:
            f.write(KV_ENTRY)


def _changed(root: Path):
    """The files of the copy that differ from the repository's, or are new."""
    out = []
    for path in sorted((root / "megatron_deadpool").rglob("*.py")):
        rel = path.relative_to(root)
        orig = REPO / rel
        if not orig.exists() or orig.read_bytes() != path.read_bytes():
            out.append(str(rel))
    return out


def test_a_new_transport_is_one_module_and_one_entry(tmp_path):
    """(b): a store-backed transport is ``mirror/kv_transport.py`` and one registry entry in
    ``mirror/transport.py``: the flag offers it, the runtime's settings take it, it passes
    the conformance exchange, and the structure checks pass on the copy (its layer is its
    folder's, the doc's ``mirror/*_transport`` row maps it). Without the entry it fails."""
    root = _copy(tmp_path)
    _add_kv_transport(root)
    assert _changed(root) == ["megatron_deadpool/mirror/kv_transport.py",
                              "megatron_deadpool/mirror/transport.py"]
    ran = _run(root, ["-c", KV_RUN, str(root)])
    assert ran.returncode == 0 and "KV RAN" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-5000:]
    checked = _run(root, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          str(TESTS / "test_structure.py")])
    assert checked.returncode == 0, checked.stdout[-5000:] + checked.stderr[-2000:]

    planted = _copy(tmp_path / "planted")
    _add_kv_transport(planted, entry=False)  # the registry line forgotten
    ran = _run(planted, ["-c", KV_RUN, str(planted)])
    assert ran.returncode != 0 and "invalid choice: 'kv'" in ran.stderr, ran.stderr[-3000:]
