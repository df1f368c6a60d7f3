"""The common changes of docs/architecture.md ("Common changes"), made for real: each in a
temporary copy of the package, touching only the files the doc names, and shown to run there
(the copy's own code, on its own PYTHONPATH) and to pass the structure checks
(tests/test_structure.py, pointed at the copy by DEADPOOL_STRUCTURE_ROOT). A planted defect
(the change made without one of its files) fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def copy_repo(tmp_path: Path) -> Path:
    """A copy of the package, its tests and the docs the tests read, as a clone has them."""
    root = tmp_path / "copy"
    for folder in ("megatron_deadpool", "tests", "docs"):
        shutil.copytree(REPO / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "img", "data"))
    shutil.copytree(REPO / "docs" / "data", root / "docs" / "data")
    return root


def run_tests(root: Path, files, select: str = "", timeout: int = 900
              ) -> subprocess.CompletedProcess:
    """The copy's own tests ``files`` (the part of the fast suite a change could break; of
    them ``select``, a ``-k`` expression, if given), on the copy's package."""
    return _run(root, ["-m", "pytest", "-v", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                       *(["-k", select] if select else []),
                       *[str(root / "tests" / f) for f in files]], timeout)


def _run(root: Path, args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python ARGS`` on the copy: its package first on the path, the structure checks
    pointed at it."""
    env = dict(os.environ, PYTHONPATH=str(root), DEADPOOL_STRUCTURE_ROOT=str(root),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


# (b) a store-backed mirror transport: the backend module and one registry entry

KV_BACKEND = '''\
\"\"\"A store-backed transport: every message is one key of the generation's store, sealed
with the job's secret (mirror/transport_api.py, the contract).\"\"\"

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

import torch

from ..base.errors import MirrorError, TransportTimeout
from .transport_api import MirrorTransport, count_messages

TAG = 32  # bytes of the HMAC-SHA256 in front of every message


class KvTransport(MirrorTransport):
    \"\"\"Messages as store keys: ``kv/<gen>/<src>-<dst>/<n>``, each value the tag of (job,
    generation, sender, receiver, n, payload) followed by the payload.\"\"\"

    kind = "kv"

    def __init__(self, store, rank: int, world_size: int, collectives, secret: str, gen: int,
                 timeout_s: float):
        if not secret:
            raise MirrorError("the kv mirror transport needs the job secret")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.collectives, self.gen, self.timeout_s = collectives, gen, timeout_s
        self._key = hashlib.sha256(f"kv-transport:{secret}".encode()).digest()
        self._seq = {}  # (way, src, dst) -> the last message's number

    def _next(self, way: str, src: int, dst: int):
        n = self._seq[(way, src, dst)] = self._seq.get((way, src, dst), -1) + 1
        return f"kv/{self.gen}/{src}-{dst}/{n}", f"{self.gen}:{src}:{dst}:{n}:".encode()

    def _tag(self, head: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, head + payload, hashlib.sha256).digest()

    def exchange(self, sends, recvs, timeout_s=None) -> None:
        count_messages(sends, recvs)
        for dst, buf in sends:
            key, head = self._next("out", self.rank, dst)
            payload = buf.numpy().tobytes()
            self.store.set(key, self._tag(head, payload) + payload)
        limit = self.timeout_s if timeout_s is None else timeout_s
        for src, buf in recvs:
            key, head = self._next("in", src, self.rank)
            try:
                self.store.wait([key], timedelta(seconds=limit))
            except Exception as exc:  # noqa: BLE001 - the store's timeout, as a peer's loss
                raise TransportTimeout(f"kv: no message from rank {src} in {limit:g}s") from exc
            data = self.store.get(key)
            tag, payload = data[:TAG], data[TAG:]
            if not hmac.compare_digest(tag, self._tag(head, payload)):
                raise MirrorError(f"kv: the message {key} from rank {src} failed its tag")
            if len(payload) > buf.numel():
                raise MirrorError(f"kv: {len(payload)} bytes from rank {src} for a "
                                  f"{buf.numel()}-byte buffer")
            buf[:len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def all_ok(self, ok, timeout_s=None):
        return self.collectives.all_ok(ok, timeout_s)

    def all_gather_int(self, value, timeout_s=None):
        return self.collectives.all_gather_int(value, timeout_s)

    def all_gather_json(self, obj, timeout_s=None):
        return self.collectives.all_gather_json(obj, timeout_s)

    def gather_from(self, value, ranks, timeout_s=None):
        return self.collectives.gather_from(value, ranks, timeout_s)
'''

KV_ENTRY = '''

@register_transport("kv", "the generation's store, one sealed key per message")
def _kv(ctx: TransportContext) -> "MirrorTransport":
    from .kv_transport import KvTransport

    return KvTransport(ctx.store, ctx.rank, ctx.world_size, ctx.collectives, ctx.secret,
                       ctx.gen, ctx.timeout_s)
'''

# runs in the copy: the flag offers it, the settings take it, and a message written to the
# store by a client without the secret is refused, never copied into the buffer (the
# conformance, in real processes with a dead peer, is the copy's tests/test_transport.py)
KV_RUN = textwrap.dedent(f'''
    import argparse, sys
    import torch
    import megatron_deadpool
    from megatron_deadpool.base.config import DeadpoolConfig
    from megatron_deadpool.base.errors import MirrorError
    from megatron_deadpool.control.link import MirrorSettings
    from megatron_deadpool.flags import add_deadpool_args
    from megatron_deadpool.mirror.transport import TransportContext, create_transport
    assert megatron_deadpool.__file__.startswith(sys.argv[1]), megatron_deadpool.__file__
    sys.path.insert(0, {str(TESTS)!r})
    from test_transport import SECRET

    parser = add_deadpool_args(argparse.ArgumentParser())
    cfg = DeadpoolConfig.from_args(parser.parse_args(["--deadpool-mirror-transport", "kv"]))
    assert MirrorSettings(transport=cfg.mirror_transport).transport_name == "kv"
    flag = next(a for a in parser._actions if "--deadpool-mirror-transport" in a.option_strings)
    assert "kv" in flag.choices and "or 'kv', the generation's store, one sealed" in flag.help

    store = torch.distributed.HashStore()
    t = create_transport("kv", TransportContext(store, 1, 2, None, secret=SECRET, gen=0,
                                                timeout_s=5))
    forged = bytes(32) + bytes([7]) * 8  # written by a store client without the secret
    store.set("kv/0/0-1/0", forged)
    buf = torch.zeros(8, dtype=torch.uint8)
    try:
        t.exchange([], [(0, buf)])
    except MirrorError as exc:
        assert "failed its tag" in str(exc) and int(buf.sum()) == 0, exc
    else:
        raise AssertionError("a forged message was taken")
    print("KV RAN")
''')


def first_free(name: str, taken) -> str:
    """``name``, the docs' example, unless this repository holds it already (a newcomer who
    made the change from the docs); then ``name2``, ``name3``... Each change's test then
    makes the change again, beside theirs, so that it passes in their clone too."""
    n = 1
    while (name if n == 1 else f"{name}{n}") in taken:
        n += 1
    return name if n == 1 else f"{name}{n}"


def example_name() -> str:
    """The name (b)'s example transport takes here: ``kv`` unless a transport of that name,
    or its module, is there already."""
    from megatron_deadpool.mirror.transport import transport_names

    modules = {p.name[:-len("_transport.py")]
               for p in (REPO / "megatron_deadpool" / "mirror").glob("*_transport.py")}
    return first_free("kv", set(transport_names()) | modules)


def named(text: str, name: str) -> str:
    """The docs' example (``kv``, ``kv_transport``, ``kv/<gen>/...``) under ``name``."""
    return text if name == "kv" else text.replace("kv", name)


def _add_kv_transport(root: Path, name: str, entry: bool = True) -> None:
    """The change as docs/architecture.md (b) gives it, under ``name``: a backend module,
    one entry, and in tests/ its CONFORMANCE entry."""
    mirror = root / "megatron_deadpool" / "mirror"
    (mirror / f"{name}_transport.py").write_text(named(KV_BACKEND, name))
    if entry:
        with open(mirror / "transport.py", "a") as f:
            f.write(named(KV_ENTRY, name))
    conformance = root / "tests" / "test_transport.py"
    text = conformance.read_text()
    listed = re.search(r"^CONFORMANCE = \[(.*)\]$", text, re.M)
    assert listed, "tests/test_transport.py has no one-line CONFORMANCE list"
    conformance.write_text(text[:listed.end(1)] + f', "{name}"' + text[listed.end(1):])

# (b)'s part of the fast suite: the flag, the registry and the new transport's conformance,
# the house (the other transports' conformance runs in the repository's own suite)
TRANSPORT_TESTS = ("test_config.py", "test_transport.py", "test_structure.py")
TRANSPORT_SELECT = ("transport and not conformance or conformance and {name} or registered "
                    "or test_structure")


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
    ``mirror/transport.py`` (plus its CONFORMANCE entry in tests/): the flag offers it, the
    runtime's settings take it, a forged message is refused, and the part of the fast suite
    it could break passes on the copy (``TRANSPORT_TESTS``: the conformance in three real
    processes with a dead peer, the flag, the structure checks: its layer is its folder's,
    the doc's ``mirror/*_transport`` row maps it). Without the entry it fails."""
    name = example_name()
    root = copy_repo(tmp_path)
    _add_kv_transport(root, name)
    assert _changed(root) == [f"megatron_deadpool/mirror/{name}_transport.py",
                              "megatron_deadpool/mirror/transport.py"]
    ran = _run(root, ["-c", named(KV_RUN, name), str(root)])
    assert ran.returncode == 0 and "KV RAN" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-5000:]
    checked = run_tests(root, TRANSPORT_TESTS, TRANSPORT_SELECT.format(name=name))
    assert checked.returncode == 0, checked.stdout[-5000:] + checked.stderr[-2000:]
    assert f"test_transport_conformance[{name}] PASSED" in checked.stdout, checked.stdout[-3000:]

    planted = copy_repo(tmp_path / "planted")
    _add_kv_transport(planted, name, entry=False)  # the registry line forgotten
    ran = _run(planted, ["-c", named(KV_RUN, name), str(planted)])
    assert ran.returncode != 0 and f"invalid choice: '{name}'" in ran.stderr, ran.stderr[-3000:]
