"""``deadpool bench recovery``: world-size validation and aggregation (pure), and one real
run that writes the documented JSON shape."""

import json

import pytest

from conftest import deadpool
from megatron_deadpool.apps.bench_recovery import aggregate, check_world_sizes, trainer_flags
from megatron_deadpool.apps.demo import DEMO_FLAGS
from megatron_deadpool.base.errors import DeadpoolError
from megatron_deadpool.base.vocabulary import PHASE_ORDER


def test_world_sizes_must_fit_tp2_pp2():
    assert check_world_sizes([16, 4, 8, 8]) == [4, 8, 16]
    for bad in ([], [6], [2], [4, 10]):
        with pytest.raises(DeadpoolError, match="multiples of 4"):
            check_world_sizes(bad)


def test_aggregate_gives_median_and_range_per_phase():
    samples = [{"phases_s": {ph: (i + 1) * 0.1 for ph in PHASE_ORDER},
                "total_s": (i + 1) * 0.6, "wall_s": (i + 1) * 0.5} for i in range(3)]
    samples[1]["phases_s"].pop("abort")  # a phase a run did not report counts as 0
    out = aggregate(8, samples, shard_bytes=1234)
    assert out["world_size"] == 8 and out["repeats"] == 3
    assert out["phases_s"]["detect"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert out["phases_s"]["abort"] == {"median": 0.1, "min": 0.0, "max": 0.3}
    assert out["total_s_median"] == 1.2 and out["total_s"]["max"] == 1.8
    assert out["wall_s"]["median"] == 1.0
    assert out["shard_bytes_per_rank"] == 1234


def test_the_light_job_keeps_the_layout_and_shrinks_the_model():
    assert trainer_flags(16, light=False) == DEMO_FLAGS
    light = trainer_flags(64, light=True)
    flag = dict(zip(light[::2], light[1::2]))
    assert flag["--hidden-size"] == "8" and flag["--num-layers"] == "2"
    assert flag["--global-batch-size"] == "16" and flag["--micro-batch-size"] == "1"
    for same in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--use-distributed-optimizer"):
        assert same in light and light.index(same) == DEMO_FLAGS.index(same)
    assert len(light) == len(DEMO_FLAGS)


def test_bench_units_times_each_kind_alone(tmp_path):
    out = tmp_path / "u.json"
    p = deadpool(["bench", "units", "--rounds", "1", "--n", "4", "--json", str(out)],
                 cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["unit_s"]) == {"store_ops", "connections", "groups_created",
                                "new_group_calls", "messages", "bytes", "group_members"}
    assert all(v >= 0 for v in d["unit_s"].values())
    assert d["unit_s"]["store_ops"] > 0 and d["unit_s"]["messages"] > 0
    assert d["store_ops_per_new_group"] > 0  # the counting store saw gloo's rendezvous
    assert "connections" in p.stdout
    bad = deadpool(["bench", "units", "--rounds", "0"], cwd=tmp_path)
    assert bad.returncode == 2 and "--rounds" in bad.stderr


def test_cli_rejects_bad_world_sizes(tmp_path):
    p = deadpool(["bench", "recovery", "--world-sizes", "6"], cwd=tmp_path)
    assert p.returncode == 2 and "multiples of 4" in p.stderr


@pytest.mark.slow
def test_bench_recovery_writes_phases_per_world_size(tmp_path):
    out = tmp_path / "r.json"
    p = deadpool(["bench", "recovery", "--json", str(out), "--world-sizes", "4",
                  "--repeats", "1", "--no-hang"], cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    (run,) = d["runs"]
    assert run["world_size"] == 4 and run["repeats"] == 1
    assert set(run["phases_s"]) == set(PHASE_ORDER)
    for ph in PHASE_ORDER:
        v = run["phases_s"][ph]
        assert v["min"] <= v["median"] <= v["max"]
    assert run["phases_s"]["detect"]["median"] > 0
    assert run["total_s_median"] == pytest.approx(
        sum(run["phases_s"][ph]["median"] for ph in PHASE_ORDER), abs=1e-3)
    assert run["wall_s"]["median"] > 0
    assert run["shard_bytes_per_rank"] > 0
    assert "workers.log" in p.stdout and "W=4" in p.stdout
