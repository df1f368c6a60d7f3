"""The Megatron-LM tree for tests: ``MEGATRON_LM_DIR`` (a user's checkout, copied, never
modified) or the pinned ``git archive`` (``MEGATRON_LM_ARCHIVE``, else
``../shared/megatron-lm/Megatron-LM-<tag>.tar.gz`` beside the repository), unpacked into a
temporary directory; each archive is checked against its tag's commit (``tags.py``, read
from ``patches/<tag>/COMMIT``). Missing both, the tests skip, except where
``DEADPOOL_REQUIRE_MLM=1`` or ``CI=true``: there they fail (CI must run them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Optional

import pytest

from megatron_deadpool.adapters import tags

REPO = Path(__file__).resolve().parents[1]
# The default tree: the oldest supported tag (the project's default environment runs it);
# MEGATRON_LM_DIR and MEGATRON_LM_ARCHIVE stand for it. Every tag's archive lies beside it.
PINNED = tags.NAMES[0]


def _required() -> bool:
    return os.environ.get("DEADPOOL_REQUIRE_MLM") == "1" or os.environ.get("CI") == "true"


def find_archive(tag: str = PINNED) -> Optional[Path]:
    env = os.environ.get("MEGATRON_LM_ARCHIVE") if tag == PINNED else None
    candidates = [Path(env)] if env else []
    candidates.append(REPO.parent / "shared" / "megatron-lm" / f"Megatron-LM-{tag}.tar.gz")
    return next((c for c in candidates if c.is_file()), None)


def archive_commit(path: Path) -> str:
    with open(path, "rb") as f:
        data = subprocess.run(["gzip", "-dc"], stdin=f, capture_output=True, check=True).stdout
    r = subprocess.run(["git", "get-tar-commit-id"], input=data, capture_output=True,
                       check=True)
    return r.stdout.decode().strip()


def pristine_tree(dest: Path, tag: str = PINNED) -> Path:
    """An unmodified tree of ``tag`` under ``dest``; skips (or fails in CI) if none."""
    src = os.environ.get("MEGATRON_LM_DIR") if tag == PINNED else None
    if src:
        out = dest / "Megatron-LM"
        shutil.copytree(src, out, ignore=shutil.ignore_patterns(".git", "__pycache__",
                                                                "helpers_cpp*.so"))
        return out
    archive = find_archive(tag)
    if archive is None:
        msg = (f"no Megatron-LM tree: set MEGATRON_LM_DIR or MEGATRON_LM_ARCHIVE "
               f"(the Megatron-LM-{tag}.tar.gz git archive of tag {tag})")
        if _required():
            pytest.fail(msg + " (required here: CI / DEADPOOL_REQUIRE_MLM=1)")
        pytest.skip(msg)
    commit, want = archive_commit(archive), tags.named(tag).commit
    assert commit == want, f"{archive} is commit {commit}, not {want}"
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    return dest / "Megatron-LM"


# Each tag's Python (tags.py): core_v0.19.0 needs 3.12, which `make venv` puts in .venv312
VENV312 = REPO / ".venv312" / "bin" / "python"


def python_for(tag: str) -> str:
    """The interpreter that runs ``tag``'s tree: this one if it is new enough, else
    ``DEADPOOL_PY312`` or ``.venv312`` (``make venv``); skips (fails in CI) if none."""
    need = tags.named(tag).python
    if sys.version_info[:2] >= need:
        return sys.executable
    for cand in (os.environ.get("DEADPOOL_PY312"), str(VENV312)):
        if cand and Path(cand).is_file():
            return cand
    msg = f"{tag} needs Python >= {need}: run `make venv` (it makes .venv312)"
    if _required():
        pytest.fail(msg + " (required here: CI / DEADPOOL_REQUIRE_MLM=1)")
    pytest.skip(msg)


_PATCHED = {}


def patched_tree(tmp_path_factory, tag: str) -> Path:
    """One pristine-then-patched tree per tag for the whole session."""
    if tag not in _PATCHED:
        t = pristine_tree(tmp_path_factory.mktemp(f"mlm-{tag}"), tag)
        r = apply_patches(t)
        assert r.returncode == 0, r.stderr
        _PATCHED[tag] = t
    return _PATCHED[tag]


def apply_patches(tree: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tree),
                           *extra], capture_output=True, text=True)
