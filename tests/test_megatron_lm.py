"""The patch series and its script on a real core_v0.16.1 tree (fast), plus the pure rules of
the Megatron-LM integration (compatibility refusals, CPU flags, tree checks)."""

from __future__ import annotations

import re
import subprocess
from types import SimpleNamespace

import pytest

from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.adapters import lm_rules, tags
from megatron_deadpool.megatron import tree
from mlm import REPO, apply_patches, pristine_tree

SERIES = {d.name: sorted(d.glob("[0-9][0-9][0-9][0-9]-*.patch"))
          for d in sorted((REPO / "patches").glob("core_v*"))}


@pytest.fixture
def mlm_tree(tmp_path):
    return pristine_tree(tmp_path)


def test_apply_idempotent_and_reverse(mlm_tree):
    assert not tree.is_patched(str(mlm_tree))
    before = {p: p.read_bytes() for p in (mlm_tree / "megatron" / "training").glob("*.py")}
    r = apply_patches(mlm_tree)
    assert r.returncode == 0, r.stderr
    assert "applied 3 patch(es)" in r.stdout
    assert tree.is_patched(str(mlm_tree))
    r = apply_patches(mlm_tree)
    assert r.returncode == 0 and "already applied" in r.stdout, r.stdout + r.stderr
    r = apply_patches(mlm_tree, "--reverse")
    assert r.returncode == 0 and "removed" in r.stdout, r.stderr
    after = {p: p.read_bytes() for p in (mlm_tree / "megatron" / "training").glob("*.py")}
    assert after == before  # byte-identical to the tag again
    assert not tree.is_patched(str(mlm_tree))


def test_refuses_an_edited_training_py(mlm_tree):
    f = mlm_tree / "megatron" / "training" / "training.py"
    f.write_text(f.read_text() + "\n# a local edit\n")
    r = apply_patches(mlm_tree)
    assert r.returncode == 2
    assert "megatron/training/training.py" in r.stderr and "differs" in r.stderr
    # a tree that matches neither tag (a core_v0.18.0, say): every supported tag named
    assert all(f"{t.name} ({t.commit[:7]})" in r.stderr for t in tags.TAGS), r.stderr
    assert not tree.is_patched(str(mlm_tree))


def test_refuses_a_git_checkout_at_another_commit(mlm_tree):
    git = ["git", "-C", str(mlm_tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "not the tag"], check=True)
    r = apply_patches(mlm_tree)
    assert r.returncode == 2 and "not a supported tag" in r.stderr, r.stderr
    assert "core_v0.16.1" in r.stderr and "core_v0.19.0" in r.stderr


def test_refuses_a_non_tree(tmp_path):
    r = apply_patches(tmp_path)
    assert r.returncode == 2 and "not a Megatron-LM tree" in r.stderr


@pytest.mark.parametrize("tag", sorted(SERIES))
def test_patch_series_is_small_and_only_calls_the_package(tag):
    added = 0
    assert len(SERIES[tag]) == 3
    for p in SERIES[tag]:
        text = p.read_text()
        for hunk in re.split(r"^@@.*@@.*$", text, flags=re.M)[1:]:
            plus = [x for x in hunk.splitlines() if x.startswith("+") and not x.startswith("+++")]
            added += len(plus)
            # into the module, or on the session it returns (join, session)
            assert any("deadpool_lm" in x or re.search(r"\bdeadpool\.\w+", x) for x in plus), \
                f"{p.name}: a hunk without a call into megatron_deadpool:\n{hunk}"
    assert 0 < added <= 150
    readme = (REPO / "README.md").read_text()
    assert f"{tag}: adds {added} lines" in readme  # the README states the count


def test_tree_checks(mlm_tree):
    root = str(mlm_tree)
    assert tree.is_megatron_tree(root) and tree.version(root) == "0.16.1"
    with pytest.raises(ConfigError, match=r"\(core_v0.16.1\) is not patched"):
        tree.check_for_deadpool(root)
    assert apply_patches(mlm_tree).returncode == 0
    assert tree.check_for_deadpool(root).name == "core_v0.16.1"
    # the tag comes from the files, not from package_info.py's version string
    info = mlm_tree / "megatron" / "core" / "package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 17"))
    assert tree.check_for_deadpool(root).name == "core_v0.16.1"
    f = mlm_tree / "megatron" / "training" / "training.py"
    f.write_text(f.read_text() + "\n# a local edit\n")
    with pytest.raises(ConfigError, match="matches no supported tag.*core_v0.19.0"):
        tree.check_for_deadpool(root)


def test_dataset_helper_built_once_per_tree(mlm_tree):
    logs = []
    path = tree.build_dataset_helper(str(mlm_tree), logs.append)
    assert path.endswith(tree.ext_suffix()) and len(logs) == 1
    assert tree.build_dataset_helper(str(mlm_tree), logs.append) == path
    assert len(logs) == 1  # second call: already there, nothing done


# ------------------------------------------------------------------ pure rules
def _args(**kw):
    base = dict(use_distributed_optimizer=True, virtual_pipeline_model_parallel_size=None,
                context_parallel_size=1, expert_model_parallel_size=1,
                num_distributed_optimizer_instances=1, rampup_batch_size=None,
                dataloader_type="single", yaml_cfg=None, cuda_graph_impl="none",
                non_persistent_ckpt_type=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_supported_config_passes():
    assert lm_rules.unsupported_args(_args()) == []
    # --async-save through a swap (adapters/async_saves.py), with megatron-core's writer
    assert lm_rules.unsupported_args(_args(async_save=True, async_strategy="mcore")) == []
    assert lm_rules.unsupported_args(_args(async_save=True)) == []  # core_v0.16.1: no flag


@pytest.mark.parametrize("kw, needle", [
    (dict(inprocess_restart=True), "--inprocess-restart"),
    (dict(enable_ft_package=True), "--enable-ft-package"),
    (dict(use_distributed_optimizer=False), "--use-distributed-optimizer"),
    (dict(async_save=True, async_strategy="nvrx"), "--async-strategy nvrx"),
    (dict(non_persistent_ckpt_type="local"), "--non-persistent-ckpt-type local"),
    (dict(context_parallel_size=2), "--context-parallel-size"),
    (dict(num_distributed_optimizer_instances=2), "--num-distributed-optimizer-instances"),
    (dict(rampup_batch_size=["16", "16", "100"]), "--rampup-batch-size"),
    (dict(tp_comm_overlap=True), "--tp-comm-overlap"),
    (dict(cuda_graph_impl="local"), "CUDA graphs"),
    (dict(nccl_ub=True), "--use-nccl-ub"),
    (dict(use_megatron_fsdp=True), "--use-megatron-fsdp"),
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
    (dict(dataloader_type="external"), "--dataloader-type external"),
    (dict(use_precision_aware_optimizer=True), "--use-precision-aware-optimizer"),
    (dict(full_validation=True), "--full-validation"),
    (dict(step_batch_size_schedule="1:8"), "--step-batch-size-schedule"),
    (dict(exit_signal_handler_for_training=True), "--exit-signal-handler-for-training"),
    (dict(gtp_weight_remat_size=2), "--tensor-parallel-num-weight-shards"),
    (dict(fp8="hybrid"), "--fp8-format"),
])
def test_each_refusal_names_its_flag(kw, needle):
    found = lm_rules.unsupported_args(_args(**kw))
    assert len(found) == 1 and needle in found[0], found


def test_cpu_flags_added_only_when_missing():
    out = lm_rules.cpu_flags(["--num-layers", "2", "--transformer-impl", "transformer_engine",
                        "--num-workers=2"])
    assert out[:4] == ["--num-layers", "2", "--transformer-impl", "transformer_engine"]
    assert out.count("--transformer-impl") == 1 and "--num-workers" not in out
    for flag in ("--distributed-backend", "--no-gradient-accumulation-fusion",
                 "--no-rope-fusion", "--eval-iters"):
        assert flag in out
    full = lm_rules.cpu_flags([])
    assert lm_rules.cpu_flags(full) == full  # idempotent


def test_unsupported_argv_matches_the_parsed_rules():
    assert lm_rules.unsupported_argv(["--use-distributed-optimizer", "--num-layers", "2"]) == []
    assert lm_rules.unsupported_argv(["--use-distributed-optimizer", "--fp8-format",
                                      "e4m3"]) == [lm_rules.unsupported_args(_args(fp8="e4m3"))[0]]
    assert lm_rules.unsupported_argv([]) == [lm_rules.unsupported_args(_args(
        use_distributed_optimizer=False))[0]]
    bad = lm_rules.unsupported_argv(["--use-distributed-optimizer", "--async-save",
                                     "--num-layers-per-virtual-pipeline-stage", "2",
                                     "--overlap-grad-reduce", "--overlap-param-gather",
                                     "--context-parallel-size", "2"])
    assert len(bad) == 1 and "--context-parallel-size" in bad[0]  # --async-save: supported
    nvrx = lm_rules.unsupported_argv(["--use-distributed-optimizer", "--async-save",
                                      "--async-strategy", "nvrx"])
    assert nvrx == lm_rules.unsupported_args(_args(async_save=True, async_strategy="nvrx"))
    assert lm_rules.unsupported_argv(["--use-distributed-optimizer",
                                      "--use-precision-aware-optimizer"]) == [
        lm_rules.unsupported_args(_args(use_precision_aware_optimizer=True))[0]]
    # the fallback save and its resume are accepted (tested through a stop and a resume)
    assert lm_rules.unsupported_argv(["--use-distributed-optimizer", "--deadpool-resume=d",
                                      "--deadpool-fallback-save", "d"]) == []


def test_launch_refuses_before_any_worker_starts(mlm_tree, tmp_path):
    from conftest import deadpool

    script = str(mlm_tree / "pretrain_gpt.py")
    flags = ["--use-distributed-optimizer", "--deadpool"]
    launch = ["launch", "--nodes", "2", "--procs-per-node", "1", "--device", "cpu",
              "--script", script, "--"]
    p = deadpool(launch + flags, cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and "not patched" in p.stderr and "apply_patches.sh" in p.stderr
    assert apply_patches(mlm_tree).returncode == 0
    p = deadpool(launch + flags + ["--fp8-format", "hybrid"], cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if "FP8" in x]  # one line names FP8
    assert "does not support: --fp8-format" in line, p.stderr
    assert "Traceback" not in p.stderr
