"""The Megatron-LM tags the package supports, and the one place where it acts differently
per tag (an adapter per tag: ``Tag``'s fields below the identity).

Each tag is described once, in ``patches/<tag>/``: ``COMMIT`` (its git commit),
``files.sha256`` (pre-image sha256, post-image sha256 and path of every file its patch series
touches) and ``tag.json`` (what the series does not show: the tree's version string, the
oldest Python, the adapter's fields). This module reads them: from the copy an installed
package ships (``setup.py``), else from the repository's ``patches/`` (a checkout, an editable
install). A tree is identified by the sha256 of the files the series touches (or by its git
commit, in ``scripts/apply_patches.sh``), never by ``megatron/core/package_info.py``:
core_v0.19.0 was tagged on the version-bump commit and says 0.19.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
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

    @property
    def label(self) -> str:
        """How messages name the tag: its name and short commit."""
        return f"{self.name} ({self.commit[:7]})"

    def forget_collective_caches(self, optimizer) -> None:
        for opt in [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]:
            for attr in self.collective_caches:
                if getattr(opt, attr, None) is not None:
                    setattr(opt, attr, None)


_ABOUT = ("package_version", "python", "eval_kwargs", "bucket_group_resets",
          "train_group_holders", "collective_caches")  # tag.json's keys


def _series_root() -> Optional[Path]:
    """Where the descriptions are: an installed package's copy, else the repository's."""
    package = Path(__file__).resolve().parents[1]
    for root in (package / "patches", package.parent / "patches"):
        if any(root.glob("core_v*/COMMIT")):
            return root
    return None


def _version_key(name: str) -> Tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def _read(d: Path) -> Tag:
    """One tag from its folder: ``COMMIT``, ``files.sha256`` and ``tag.json``."""
    files = {}
    for line in (d / "files.sha256").read_text().splitlines():
        pre, post, path = line.split()
        files[path] = (pre, post)
    about = json.loads((d / "tag.json").read_text())
    unknown = sorted(set(about) - set(_ABOUT))
    if unknown:
        raise ValueError(f"{d / 'tag.json'}: unknown keys {unknown} (known: {_ABOUT})")
    major, minor = (int(n) for n in about["python"].split("."))
    return Tag(d.name, (d / "COMMIT").read_text().strip(), about["package_version"],
               (major, minor), files,
               eval_kwargs=tuple(about.get("eval_kwargs", ())),
               bucket_group_resets=dict(about.get("bucket_group_resets", {})),
               train_group_holders=tuple(about.get("train_group_holders", ())),
               collective_caches=tuple(about.get("collective_caches", ())))


def _load() -> Tuple[Tag, ...]:
    root = _series_root()
    if root is None:  # a broken install: every tree is refused, saying why (patched_tag)
        return ()
    dirs = sorted((c.parent for c in root.glob("core_v*/COMMIT")),
                  key=lambda d: _version_key(d.name))
    return tuple(_read(d) for d in dirs)


TAGS = _load()  # oldest first
NAMES = tuple(t.name for t in TAGS)


def named(name: str) -> Tag:
    """The supported tag called ``name`` (a KeyError names the supported ones)."""
    for tag in TAGS:
        if tag.name == name:
            return tag
    raise KeyError(f"{name} is not a supported Megatron-LM tag; supported: {supported()}")


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
    if not TAGS:
        return "none (this installation lacks the tags' descriptions, patches/<tag>/: " \
               "reinstall megatron-deadpool)"
    return ", ".join(t.label for t in TAGS)


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
