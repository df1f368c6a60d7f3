"""A Megatron-LM source tree as ``deadpool launch --script`` uses it: its version, whether
the patch series is applied, and the one-time build of its dataset helper (once per tree,
before any worker starts, not once per rank)."""

from __future__ import annotations

import fcntl
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import Callable, Dict, Optional

from ..base.errors import ConfigError
from ..adapters import tags

DATASETS = os.path.join("megatron", "core", "datasets")


def is_megatron_tree(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "megatron", "training", "training.py"))


def version(root: str) -> Optional[str]:
    """``megatron/core/package_info.py``'s MAJOR.MINOR.PATCH, or None if absent."""
    path = os.path.join(root, "megatron", "core", "package_info.py")
    if not os.path.isfile(path):
        return None
    text = open(path).read()
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return None
    return ".".join(m.group(1) for m in parts)


def is_patched(root: str) -> bool:
    """The tree is a supported tag with its patch series applied (tags.py)."""
    tag, state = tags.identify(root)
    return tag is not None and state == "post"


def check_for_deadpool(root: str) -> "tags.Tag":
    """A clear error at launch, before any worker starts, for a tree --deadpool cannot use:
    not a supported tag (by its files' hashes), not patched, or a Python too old for it."""
    if version(root) is None:
        raise ConfigError(f"{root} has no megatron/core/package_info.py: not a Megatron-LM tree")
    tag = tags.patched_tag(root)
    if sys.version_info[:2] < tag.python:
        raise ConfigError(f"Megatron-LM {tag.name} needs Python >= "
                          f"{'.'.join(map(str, tag.python))}; this is "
                          f"{sys.version.split()[0]} (README: supported tags)")
    return tag


def ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX")


def build_dataset_helper(root: str, log: Callable[[str], None] = lambda m: None) -> str:
    """Make ``megatron/core/datasets/helpers_cpp<EXT_SUFFIX>`` exist, once per tree: copy the
    one the installed megatron-core wheel ships (same source at the pinned tag), else run the
    tree's Makefile with this interpreter's suffix (its default asks ``python3-config``,
    which may name another Python). A lock file serializes agents sharing the tree."""
    d = os.path.join(root, DATASETS)
    target = os.path.join(d, "helpers_cpp" + ext_suffix())
    if os.path.exists(target):
        return target
    with open(os.path.join(d, ".deadpool-build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(target):
            return target
        spec = importlib.util.find_spec("megatron.core")
        wheel = []
        for loc in (spec.submodule_search_locations or []) if spec else []:
            wheel += glob.glob(os.path.join(loc, "datasets", "helpers_cpp" + ext_suffix()))
        wheel = [w for w in wheel if os.path.abspath(os.path.dirname(w)) != os.path.abspath(d)]
        if wheel:
            shutil.copyfile(wheel[0], target + ".tmp")
            os.replace(target + ".tmp", target)
            log(f"dataset helper: copied from the installed megatron-core into {d}")
            return target
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        r = subprocess.run(["make", "-C", d, f"LIBEXT={ext_suffix()}"], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(target):
            raise ConfigError(f"building the dataset helper in {d} failed:\n{r.stderr[-2000:]}")
        log(f"dataset helper: built in {d}")
    return target


def prepare(root: str, cpu: bool, log: Callable[[str], None] = lambda m: None
            ) -> Dict[str, str]:
    """Environment for the workers of a script in ``root``; builds the dataset helper if
    ``root`` is a Megatron-LM tree."""
    env: Dict[str, str] = {}
    if is_megatron_tree(root) and os.path.isdir(os.path.join(root, DATASETS)):
        build_dataset_helper(root, log)
        # rank 0's compile_helpers() then finds the helper up to date: a no-op.
        env["MAKEFLAGS"] = f"LIBEXT={ext_suffix()}"
    if cpu:
        env["TORCHDYNAMO_DISABLE"] = "1"  # megatron's jit fuser is torch.compile
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # asserted by Megatron-LM when TP > 1
    return env
