"""The supported Megatron-LM tags (adapters/tags.py): each is read from its one description,
patches/<tag>/ (COMMIT, files.sha256, tag.json), and a tree is identified by its files, not by
its version string (core_v0.19.0's package_info.py says 0.19.1)."""

from __future__ import annotations

import pytest

from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.adapters import tags
from megatron_deadpool.megatron import tree
from mlm import REPO, apply_patches, pristine_tree


@pytest.mark.parametrize("tag", tags.TAGS, ids=lambda t: t.name)
def test_the_package_knows_each_series_manifest(tag):
    d = REPO / "patches" / tag.name
    assert (d / "COMMIT").read_text().strip() == tag.commit
    manifest = {}
    for line in (d / "files.sha256").read_text().splitlines():
        pre, post, path = line.split()
        manifest[path] = (pre, post)
    assert manifest == tag.files


def test_the_tags_are_the_series_folders():
    folders = sorted(d.name for d in (REPO / "patches").glob("core_v*") if d.is_dir())
    assert sorted(tags.NAMES) == folders and len(folders) >= 2
    assert list(tags.NAMES) == sorted(tags.NAMES, key=tags._version_key)  # oldest first
    assert tags.supported() == ", ".join(f"{t.name} ({t.commit[:7]})" for t in tags.TAGS)


def test_a_tag_description_with_an_unknown_key_is_refused(tmp_path):
    d = tmp_path / "core_v9.9.9"
    d.mkdir()
    (d / "COMMIT").write_text("0" * 40 + "\n")
    (d / "files.sha256").write_text(f"{'1' * 64}  {'2' * 64}  megatron/training/training.py\n")
    (d / "tag.json").write_text('{"package_version": "9.9.9", "python": "3.12"}')
    t = tags._read(d)
    assert (t.name, t.python, t.files) == (
        "core_v9.9.9", (3, 12), {"megatron/training/training.py": ("1" * 64, "2" * 64)})
    (d / "tag.json").write_text('{"package_version": "9.9.9", "python": "3.12", "eval": []}')
    with pytest.raises(ValueError, match="unknown keys"):
        tags._read(d)


@pytest.mark.parametrize("name", tags.NAMES)
def test_a_tree_is_identified_by_its_files(tmp_path, name):
    t = pristine_tree(tmp_path, name)
    tag, state = tags.identify(str(t))
    assert (tag.name, state) == (name, "pre")
    assert tree.version(str(t)) == tag.package_version  # 0.19.0's says 0.19.1
    with pytest.raises(ConfigError, match="not patched"):
        tags.patched_tag(str(t))
    r = apply_patches(t)
    assert r.returncode == 0 and f"{name}: applied 3 patch(es)" in r.stdout, r.stderr
    assert tags.patched_tag(str(t)).name == name
    r = apply_patches(t)
    assert r.returncode == 0 and "already applied" in r.stdout
    r = apply_patches(t, "--reverse")
    assert r.returncode == 0 and tags.identify(str(t)) == (tag, "pre")
