"""Last-resort persistence (``--deadpool-fallback-save DIR``, ``--deadpool-resume DIR``):
sealed mirror slots written as files, byte for byte what the mirror holds in memory.

    DIR/iter_00000012-<run>/manifest.json       {iteration, job, run, world, tp, pp, dp}
    DIR/iter_00000012-<run>/rank3-of-8.snap     header + tensors + metadata (snapshot.py)

Each saved iteration is a directory of one run (``run``: an id drawn once per launch, so two
runs of one job secret differ too) whose manifest ties its rank files to that run's job and
layout. A file is written under a temporary name, flushed, renamed, and the directory is
fsynced after the rename, so a reader never sees half a file and a crash never loses a
renamed one. Several holders of the same copy may write it; the content is the same. An
iteration is *complete* when its manifest is there and every rank of its world has a file;
files of another run in a reused directory sit in that run's directories and are never
mixed in. A resume loads the newest complete iteration of its own layout that every rank can
verify (checksum, owner, iteration, the manifest's job, layout): a damaged newest file makes
it fall back to the next complete iteration, with a warning (recovery/restore.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..base.errors import ConfigError

log = logging.getLogger(__name__)
_ITER = re.compile(r"^iter_(\d{8})-([0-9a-f]{16})$")
_FILE = re.compile(r"^rank(\d+)-of-(\d+)\.snap$")
MANIFEST = "manifest.json"
RUN_ID_KEY = "deadpool-run-id"


@dataclass(frozen=True)
class Manifest:
    """What one run's saved iterations belong to: its job (``snapshot.job_id``), its run id
    and its layout."""

    job: int
    run: str  # 16 hex digits
    world: int
    tp: int
    pp: int
    dp: int

    def layout(self) -> Tuple[int, int, int, int]:
        return self.world, self.tp, self.pp, self.dp


RUN_ID_TRIES = 8  # keys RUN_ID_KEY, RUN_ID_KEY/1, ... tried past records not signed for it
_RUN = re.compile(r"^[0-9a-f]{16}$")


def run_id(store, secret: Optional[str] = None) -> str:
    """This launch's run id: drawn by the first rank that asks, read by every other (one
    ``compare_set`` in the launch's store, which outlives the generations). ``store`` may be
    a generation's prefix of it, at any depth: a spare promoted in generation g sees the
    launch's store under more prefixes than a rank of generation 0 (its files were written
    under another run id, and no iteration was complete).

    The run id names the fallback's directories, so nothing unsigned may choose it (issue
    58: a store client without the secret set ``x/../../..`` first, and every rank wrote its
    files outside the fallback directory). The value is signed with the job ``secret``
    (None: a run without one, e.g. a test; then only its form is checked) and must be 16
    hex digits. A value that is not is refused with one line naming the key, and every rank
    goes on to the next key (``RUN_ID_KEY/1``, ...): they all read the same values, so they
    agree on the run id that the first of them drew there."""
    import secrets

    from ..membership import auth

    while getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store
    for n in range(RUN_ID_TRIES):
        key = RUN_ID_KEY if n == 0 else f"{RUN_ID_KEY}/{n}"
        mine = secrets.token_hex(8)
        sealed = auth.seal(secret, {"k": "run-id", "run": mine}) if secret else mine
        raw = store.compare_set(key, "", sealed)
        try:
            run = (auth.open_(secret, raw, k="run-id")["run"] if secret
                   else raw.decode("ascii"))
        except (auth.AuthError, UnicodeDecodeError, KeyError, TypeError):
            run = None
        if isinstance(run, str) and _RUN.match(run):
            return run
        log.warning("fallback: the run id under store key %r is %s: refused (it names "
                    "the fallback's directories), the next key is tried", key,
                    "not signed with the job secret" if secret else "not 16 hex digits")
    raise ConfigError(f"fallback: no usable run id under store keys {RUN_ID_KEY!r} .. "
                      f"'{RUN_ID_KEY}/{RUN_ID_TRIES - 1}': each was written by someone "
                      "without the job secret")


def iteration_dir(root: str, iteration: int, run: str) -> str:
    if not _RUN.match(str(run)):  # never a path out of ``root``
        raise ConfigError(f"fallback: run id {run!r} is not 16 hex digits")
    return os.path.join(root, f"iter_{iteration:08d}-{run}")


def slot_path(root: str, iteration: int, rank: int, manifest: Manifest) -> str:
    return os.path.join(iteration_dir(root, iteration, manifest.run),
                        f"rank{rank}-of-{manifest.world}.snap")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, data) -> None:
    """``data`` at ``path``: a temporary file, flushed, renamed, the directory fsynced."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _ensure_iteration_dir(root: str, iteration: int, manifest: Manifest) -> str:
    d = iteration_dir(root, iteration, manifest.run)
    if not os.path.isdir(d):
        os.makedirs(d, exist_ok=True)
        _fsync_dir(root)  # the new directory's entry
    if not os.path.exists(os.path.join(d, MANIFEST)):
        body = dict(asdict(manifest), iteration=iteration)
        _write_durably(os.path.join(d, MANIFEST), json.dumps(body, sort_keys=True).encode())
    return d


def write_slot(root: str, slot: torch.Tensor, iteration: int, rank: int,
               manifest: Manifest) -> int:
    """Write one sealed slot; returns the bytes written (0: the file already exists)."""
    path = slot_path(root, iteration, rank, manifest)
    if os.path.exists(path):
        return 0
    _ensure_iteration_dir(root, iteration, manifest)
    _write_durably(path, memoryview(slot.numpy()))
    return slot.numel()


def read_slot(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.uint8)


def read_manifest(d: str) -> Optional[Manifest]:
    """The manifest of iteration directory ``d``; None if missing or unreadable."""
    try:
        with open(os.path.join(d, MANIFEST)) as f:
            body = json.load(f)
        return Manifest(int(body["job"]), str(body["run"]), int(body["world"]),
                        int(body["tp"]), int(body["pp"]), int(body["dp"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


Key = Tuple[int, str]  # (iteration, run)


@dataclass(frozen=True)
class Saved:
    """What a directory holds: per (iteration, run), its manifest, the ranks with a file
    (of the manifest's world), and bytes."""

    root: str
    manifests: Dict[Key, Optional[Manifest]]
    ranks: Dict[Key, Set[int]]
    nbytes: Dict[Key, int]

    def complete(self, world: Optional[int] = None, layout: Optional[Tuple[int, ...]] = None
                 ) -> List[Key]:
        """(iteration, run) pairs with a manifest (of this ``world``, and ``layout``:
        ``Manifest.layout()``, when given) and a file for every rank, newest first."""
        out = []
        for key, m in self.manifests.items():
            if m is None or (world is not None and m.world != world):
                continue
            if layout is not None and m.layout() != tuple(layout):
                continue
            if self.ranks.get(key, set()) == set(range(m.world)):
                out.append(key)
        return sorted(out, reverse=True)

    def path(self, key: Key, rank: int) -> str:
        return slot_path(self.root, key[0], rank, self.manifests[key])


def scan(root: str) -> Saved:
    manifests: Dict[Key, Optional[Manifest]] = {}
    ranks: Dict[Key, Set[int]] = {}
    nbytes: Dict[Key, int] = {}
    if not os.path.isdir(root):
        return Saved(root, manifests, ranks, nbytes)
    for d in os.listdir(root):
        m = _ITER.match(d)
        if not m:
            continue
        key = (int(m.group(1)), m.group(2))
        man = manifests[key] = read_manifest(os.path.join(root, d))
        ranks[key], nbytes[key] = set(), 0
        for name in os.listdir(os.path.join(root, d)):
            f = _FILE.match(name)
            if f and man is not None and int(f.group(2)) == man.world:
                ranks[key].add(int(f.group(1)))
                nbytes[key] += os.path.getsize(os.path.join(root, d, name))
    return Saved(root, manifests, ranks, nbytes)


def resume_candidates(saved: Saved, layout: Tuple[int, int, int, int]) -> List[Key]:
    """The complete iterations a job of ``layout`` (world, tp, pp, dp) may resume from,
    newest first. Raises ConfigError naming what the directory holds when there is none."""
    root = saved.root
    done = saved.complete(layout=layout)
    if done:
        return done
    held = ", ".join(f"iteration {it} of run {run} ({_describe(saved.manifests[(it, run)])}): "
                     f"ranks {sorted(rs)}" for (it, run), rs in sorted(saved.ranks.items()))
    world, tp, pp, dp = layout
    raise ConfigError(f"--deadpool-resume {root}: no iteration saved for all {world} ranks of "
                      f"layout TP{tp}.PP{pp}.DP{dp} (it holds {held or 'nothing'})")


def _describe(m: Optional[Manifest]) -> str:
    if m is None:
        return "no manifest"
    return f"world {m.world}, TP{m.tp}.PP{m.pp}.DP{m.dp}"


def resume_from(candidates: List[Key], load_own, all_ok) -> Key:
    """The newest of ``candidates`` (``resume_candidates``) that every rank loaded.
    ``load_own(key)`` loads this rank's file of it and returns None, or why it could not (a
    damaged or foreign file); ``all_ok(ok)`` is the world's AND (one small collective per
    candidate tried). A candidate that some rank could not load is skipped with a warning:
    the resume falls back to an older complete iteration instead of failing."""
    for key in candidates:
        why = load_own(key)
        if why is not None:
            log.warning("--deadpool-resume: this rank cannot load iteration %s (run %s): %s",
                        key[0], key[1], why)
        if all_ok(why is None):
            return key
        log.warning("--deadpool-resume: iteration %s (run %s) is damaged on some rank; "
                    "falling back to an older complete iteration", key[0], key[1])
    raise ConfigError("--deadpool-resume: no complete iteration verifies on every rank "
                      f"(tried {[it for it, _ in candidates]})")


def prune_own(root: str, rank: int, manifest: Manifest, keep_from: int) -> None:
    """Delete this run's files of this rank older than ``keep_from`` (periodic saves keep
    two)."""
    saved = scan(root)
    for (it, run), rs in saved.ranks.items():
        if run == manifest.run and it < keep_from and rank in rs:
            path = slot_path(root, it, rank, manifest)
            try:
                os.remove(path)
            except OSError:
                continue  # a peer removed it first
            if rs == {rank}:  # the last file: the directory goes, manifest and all
                try:
                    os.remove(os.path.join(os.path.dirname(path), MANIFEST))
                    os.rmdir(os.path.dirname(path))
                except OSError:
                    pass  # a peer wrote a file meanwhile, or removed it first


# ---------------------------------------------------------------- mirror side
def save_held(mirror, root: str, manifest: Manifest) -> List[Tuple[int, int, int]]:
    """Write every verified slot this process holds: its own and its buddy copies, each
    iteration still in memory. Returns [(rank, iteration, bytes written)]."""
    from . import snapshot

    out = []  # (owner, iteration, slot): its own first (held.py)
    for owner, it, slot in mirror.own.copies() + mirror.held.copies():
        try:
            snapshot.verify(slot, owner, it, job=mirror.job)
        except Exception:  # noqa: BLE001 - a torn or foreign slot is not worth saving
            continue
        out.append((owner, it, write_slot(root, slot, it, owner, manifest)))
    return out


def periodic(mirror, root: str, every: int, manifest: Manifest, iteration: int) -> None:
    """After ``iteration`` committed (mirror thread): every ``every`` iterations, write this
    rank's own slot, so that a shard whose every in-memory copy dies can come from disk. Two
    saves are kept."""
    if every <= 0 or iteration % every:
        return
    write_slot(root, mirror.own.slot(iteration), iteration, mirror.rank, manifest)
    prune_own(root, mirror.rank, manifest, keep_from=iteration - every)


def adopt(mirror, data: torch.Tensor, iteration: int, job: int) -> None:
    """Load a saved slot as this rank's own copy of ``iteration``: verified against ``job``
    (its manifest's) and this rank's layout, then re-stamped with this job's id. Raises
    (MirrorCorruptError, ConfigError) and changes nothing when the file does not verify."""
    from . import snapshot

    layout = mirror.holdings.ensure_layout()
    if data.numel() != layout.total_bytes:
        raise ConfigError(f"saved state of rank {mirror.rank} iteration {iteration} has "
                          f"{data.numel()} bytes; this model's snapshot has "
                          f"{layout.total_bytes} (a different model, layout or optimizer)")
    snapshot.verify(data, mirror.rank, iteration, layout, job=job)
    mirror.own.adopt(iteration, data, mirror.job)
