"""The Megatron-LM tree for tests: ``MEGATRON_LM_DIR`` (a user's checkout, copied, never
modified) or the pinned ``git archive`` (``MEGATRON_LM_ARCHIVE``, else
``../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz`` beside the repository), unpacked
into a temporary directory. Missing both, the tests skip, except where
``DEADPOOL_REQUIRE_MLM=1`` or ``CI=true``: there they fail (CI must run them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
PINNED_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
ARCHIVE_NAME = "Megatron-LM-core_v0.16.1.tar.gz"


def _required() -> bool:
    return os.environ.get("DEADPOOL_REQUIRE_MLM") == "1" or os.environ.get("CI") == "true"


def find_archive() -> Optional[Path]:
    env = os.environ.get("MEGATRON_LM_ARCHIVE")
    candidates = [Path(env)] if env else []
    candidates.append(REPO.parent / "shared" / "megatron-lm" / ARCHIVE_NAME)
    return next((c for c in candidates if c.is_file()), None)


def archive_commit(path: Path) -> str:
    with open(path, "rb") as f:
        data = subprocess.run(["gzip", "-dc"], stdin=f, capture_output=True, check=True).stdout
    r = subprocess.run(["git", "get-tar-commit-id"], input=data, capture_output=True,
                       check=True)
    return r.stdout.decode().strip()


def pristine_tree(dest: Path) -> Path:
    """An unmodified core_v0.16.1 tree under ``dest``; skips (or fails in CI) if none."""
    src = os.environ.get("MEGATRON_LM_DIR")
    if src:
        out = dest / "Megatron-LM"
        shutil.copytree(src, out, ignore=shutil.ignore_patterns(".git", "__pycache__",
                                                                "helpers_cpp*.so"))
        return out
    archive = find_archive()
    if archive is None:
        msg = (f"no Megatron-LM tree: set MEGATRON_LM_DIR or MEGATRON_LM_ARCHIVE "
               f"(the {ARCHIVE_NAME} git archive of tag core_v0.16.1)")
        if _required():
            pytest.fail(msg + " (required here: CI / DEADPOOL_REQUIRE_MLM=1)")
        pytest.skip(msg)
    commit = archive_commit(archive)
    assert commit == PINNED_COMMIT, f"{archive} is commit {commit}, not {PINNED_COMMIT}"
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    return dest / "Megatron-LM"


def apply_patches(tree: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tree),
                           *extra], capture_output=True, text=True)
