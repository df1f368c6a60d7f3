"""The supported Megatron-LM tags (adapters/tags.py): the package's copy of each series'
manifest equals patches/<tag>/, and a tree is identified by its files, not by its version
string (core_v0.19.0's package_info.py says 0.19.1)."""

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


@pytest.mark.parametrize("name", ["core_v0.16.1", "core_v0.19.0"])
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
