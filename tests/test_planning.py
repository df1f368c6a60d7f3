"""Capacity planning (base/planning.py, `deadpool plan`): parameter counts
against the models' published sizes, the memory formulas against hand-computed values, and
the refusal naming the limit."""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from megatron_deadpool.base import planning

PRESETS = {p.stem: json.loads(p.read_text()) for p in (REPO / "configs" / "presets").glob("*.json")}
NOMINAL = {"gpt-1.3b": 1.3e9, "gpt-7b": 6.7e9, "gpt-13b": 13e9, "gpt-65b": 65e9}


def test_every_preset_is_there_with_both_systems():
    assert set(PRESETS) == set(NOMINAL)
    for name, p in PRESETS.items():
        assert p["name"] == name
        assert set(p["systems"]) == {"perlmutter", "vista"}


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_parameter_count_matches_the_name(name):
    n = planning.total_params(PRESETS[name]["model"])
    assert abs(n - NOMINAL[name]) / NOMINAL[name] < 0.05, n


@pytest.mark.parametrize("name", sorted(NOMINAL))
@pytest.mark.parametrize("system", ["perlmutter", "vista"])
def test_preset_layouts_are_valid_and_fit(name, system):
    t = planning.plan(PRESETS[name], system)
    lay = t["layout"]
    assert lay["tp"] * lay["pp"] * lay["dp"] == lay["nodes"] * lay["gpus_per_node"]
    assert planning.refusal(t, 1) is None and planning.refusal(t, 2) is None


def test_tiny_model_by_hand():
    # h=8, f=32, L=2, V=128 (padded to 128 at TP1), S=16; TP1 PP1 DP2 on 2 nodes x 1 GPU
    m = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 16,
         "vocab_size": 128}
    layer = 4 * 64 + 2 * 8 * 32 + 9 * 8 + 32
    assert planning.total_params(m) == 2 * layer + (128 + 16) * 8 + 16
    lay = planning.Layout(tp=1, pp=1, dp=2, nodes=2, gpus_per_node=1)
    n = planning.params_per_rank(m, 1, 1)
    assert n == planning.total_params(m)
    assert planning.shard_bytes(m, lay) == 12 * -(-n // 2)
    slot = 12 * -(-n // 2) + 65536
    assert planning.host_bytes_per_rank(m, lay, 1) == 4 * slot
    assert planning.host_bytes_per_rank(m, lay, 2) == 6 * slot
    # DP = 1: the bf16 params are mirrored too
    one = planning.Layout(tp=1, pp=1, dp=1, nodes=1, gpus_per_node=1)
    assert planning.mirror_slot_bytes(m, one) == 12 * n + 2 * n + 65536


def test_tensor_and_pipeline_split_the_rank_share():
    m = PRESETS["gpt-13b"]["model"]
    full = planning.params_per_rank(m, 1, 1)
    assert planning.params_per_rank(m, 4, 1) < full / 3.5
    h, f = m["hidden_size"], 4 * m["hidden_size"]
    layer = 4 * h * h + 2 * h * f + 9 * h + f
    # PP8: the first stage is the heaviest: 5 layers + word and position embeddings
    assert planning.params_per_rank(m, 1, 8) == 5 * layer + (51200 + 2048) * h


def test_refuses_a_mirror_that_does_not_fit_and_names_the_limit():
    t = planning.plan(PRESETS["gpt-65b"], "vista", nodes=16)  # PP16, DP1
    assert t["layout"]["dp"] == 1
    reason = planning.refusal(t, 1)
    assert reason and "120 GB" in reason and "K=1" in reason and "GH200" in reason


def test_bad_layouts_are_refused():
    with pytest.raises(planning.PlanError, match="multiple"):
        planning.plan(PRESETS["gpt-65b"], "perlmutter", nodes=7)
    with pytest.raises(planning.PlanError, match="unknown system"):
        planning.plan(PRESETS["gpt-7b"], "frontier")


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "plan", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_cli_prints_the_table():
    p = _plan("--preset", "gpt-65b", "--system", "perlmutter", "--nodes", "64")
    assert p.returncode == 0, p.stderr
    assert "optimizer shard per rank" in p.stdout and "K=1" in p.stdout and "K=2" in p.stdout
    assert "per node" in p.stdout


def test_cli_refuses_with_the_reason():
    p = _plan("--preset", "gpt-65b", "--system", "vista", "--nodes", "16")
    assert p.returncode == 1
    assert "refused" in p.stderr and "120 GB" in p.stderr
    p = _plan("--preset", "gpt-65b", "--system", "vista", "--nodes", "16", "--flags")
    assert p.returncode == 2 and p.stdout == ""


def test_cli_flags_parse_as_trainer_flags():
    from megatron_deadpool.trainer.args import parse_args, validate

    p = _plan("--preset", "gpt-7b", "--system", "perlmutter", "--nodes", "16", "--flags")
    assert p.returncode == 0, p.stderr
    args = validate(parse_args(p.stdout.split()), 16 * 4)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (4, 2)
