"""The Megatron-LM tags the package supports, and the one place where it acts differently
per tag (an adapter per tag: ``Tag``'s fields below the identity).

A tree is identified by the sha256 of the files the tag's patch series touches (or by its
git commit, in ``scripts/apply_patches.sh``), never by ``megatron/core/package_info.py``:
core_v0.19.0 was tagged on the version-bump commit and says 0.19.1. ``patches/<tag>/`` holds
each series and its manifest (``files.sha256``); ``FILES`` below repeats the manifest for an
installed package without the repository (``tests/test_tags.py`` keeps them equal).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ..base.errors import ConfigError


@dataclass(frozen=True)
class Tag:
    name: str
    commit: str
    package_version: str             # what the tree's package_info.py says
    python: Tuple[int, int]          # the oldest Python the tag runs on
    files: Dict[str, Tuple[str, str]]  # path -> (pre-image, post-image) sha256
    # ---- the adapter: what differs between the tags, as data
    # evaluate_and_print_results' extra keyword arguments, taken from train()'s arguments
    eval_kwargs: Tuple[str, ...] = ()
    # bucket-group fields a dropped step must reset besides the 0.16.1 ones (adapters/ddp.py)
    bucket_group_resets: Dict[str, object] = field(default_factory=dict)
    # train()'s extra arguments that hold process groups (rebound like the model's)
    train_group_holders: Tuple[str, ...] = ()
    # optimizer attributes caching a collective's result: a promoted spare's are empty, so
    # after a restore every rank forgets them and the collective runs on all ranks again
    collective_caches: Tuple[str, ...] = ()

    def forget_collective_caches(self, optimizer) -> None:
        for opt in [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]:
            for attr in self.collective_caches:
                if getattr(opt, attr, None) is not None:
                    setattr(opt, attr, None)


TAGS = (
    Tag("core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6", "0.16.1", (3, 10), {
        "megatron/training/arguments.py": (
            "cf7544e48b49c9ebce2160e2369ee0c8bd6560c17dfc7c34fda2df9997629639",
            "ffd547913ba5342b504ede8a2a63b62766898b0ba65ef05c5807d03cc7471a4a"),
        "megatron/training/initialize.py": (
            "68683f66b33aea6d80d880473e26e578d0158d4d0aa86e77bee70dad750c6f58",
            "63bb0c244f5ab81fd2f93caf9afa697f54f3055d46105cb3102ea602096ec746"),
        "megatron/training/training.py": (
            "457cd234a88659aa395a988366e60e61f2c9d16a51df7efc8cc09c1f22fd48b1",
            "834d85c9db3795ef238381fa2dd39c54bdca7eff9a49ed24b98c176d6d3af886"),
    }),
    Tag("core_v0.19.0", "5be9626709af2722333bf54797c954c09edeada3", "0.19.1", (3, 12), {
        "megatron/training/arguments.py": (
            "f7fad20bc0e0cd9ba4b9ba7e70fa1a1b77030dfd020a7edb50b1d3b3aa41ebf6",
            "f22f0f774a61825135c745d6d0619a26682384ddceeec01e6faf1fc46ceae227"),
        "megatron/training/initialize.py": (
            "a9657afc72c7b236eda0ecdad3bc292615f492f8aa962b4f411c2f3c1314751d",
            "8acf849f48afa82a0b9973bb84aecfc7482257ede089121ee31834e920e70545"),
        "megatron/training/training.py": (
            "d968ef8216f63d6373372190ac895fc905234c116bba3e804d2951876e6ad98c",
            "1bec36557e2dbe7919372df83c97e36b4ac3b093d318cea8ae2fb208ef9f6d84"),
    }, eval_kwargs=("pg_collection", "p2p_communicator"),
        bucket_group_resets={"grad_reduce_finished": False},
        train_group_holders=("pg_collection", "p2p_communicator"),
        collective_caches=("_has_grad_norm_group_cache",)),
)
NAMES = tuple(t.name for t in TAGS)


def _sha(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def identify(root: str) -> Tuple[Optional[Tag], str]:
    """(tag, "pre" | "post") for a tree whose every patched file is at that tag's pre- or
    post-image, else (None, a description of the first difference per tag)."""
    why = []
    for tag in TAGS:
        sums = {p: _sha(os.path.join(root, p)) for p in tag.files}
        if all(sums[p] == pre for p, (pre, _) in tag.files.items()):
            return tag, "pre"
        if all(sums[p] == post for p, (_, post) in tag.files.items()):
            return tag, "post"
        bad = [p for p, pp in tag.files.items() if sums[p] not in pp]
        why.append(f"{tag.name}: " + (f"{bad[0]} {'differs' if sums[bad[0]] else 'missing'}"
                                      if bad else "partly patched"))
    return None, "; ".join(why)


def supported() -> str:
    return ", ".join(f"{t.name} ({t.commit[:7]})" for t in TAGS)


def patched_tag(root: str) -> Tag:
    """The tag of a patched tree, or a ConfigError that says what to do."""
    tag, state = identify(root)
    if tag is None:
        raise ConfigError(f"the Megatron-LM tree {root} matches no supported tag (by sha256: "
                          f"{state}); supported: {supported()}")
    if state != "post":
        raise ConfigError(f"the Megatron-LM tree {root} ({tag.name}) is not patched for "
                          f"--deadpool: run scripts/apply_patches.sh {root}")
    return tag
