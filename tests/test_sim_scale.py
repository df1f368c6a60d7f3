"""``deadpool sim``'s default law at scale (issue 57, apps/sim_scale.py): megatron-core's
group plan computed for the layout at each GPU count, the count law fitted to the gloo
runs up to W = 32, and unit costs at scale, every one listed with its status and source."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_deadpool.apps import sim, sim_measured, sim_scale
from megatron_deadpool.apps.cli import main

REPO = sim_scale.DATA.parents[1]
MEASURED = sim_scale.MEASURED_FILE


def test_the_default_sim_projects_from_the_plan_with_every_assumption_listed(tmp_path, capsys):
    assert main(["sim", "--json", str(tmp_path / "s.json")]) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["law"] == "scale" and result["measured_file"].endswith(MEASURED.name)
    assert set(result["lost_per_failure_s"]["hotswap"]) == {"512", "4096", "100000"}
    assert [v["world_size"] for v in result["validation"]] == [8, 16, 32]
    assert all(v["within_25pct"] and v["method"] == "leave-one-out"
               for v in result["validation"]), result["validation"]
    assert [v["world_size"] for v in result["validation_outside_fit"]] == [64]
    for u in result["units_at_scale"]:
        assert u["status"] in ("measured here", "assumed", "counted in the code") \
            and len(u["source"]) > 10, u
    top = result["scaling_law"]["rebuild_groups"]["terms_at"]["100000"]
    # no group of every rank: the grad stats are staged (adapters/groups.py)
    assert top["nccl_init TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP (12500)"] > 0
    assert not any("(100000)" in k for k in top)
    groups = result["plans"]["100000"]["busiest_survivor_groups"]
    assert [g["size"] for g in groups] == [3125, 12500]
    lost = result["lost_per_failure_s"]["hotswap"]["100000"]
    # megatron's group of every rank, made again at each recovery with --deadpool-grad-stats
    # world (the training default), costs more: projected beside it
    assert result["assumptions"]["grad_stats"] == "staged"
    assert result["grad_stats_other"]["lost_per_failure_s"]["100000"] > lost + 20
    assert lost == pytest.approx(sum(result["per_scale"]["100000"]["hotswap_breakdown_s"]
                                     .values()), abs=1e-3)
    util = result["steady_store_utilization"]
    assert util["512"] < util["4096"] < util["100000"]
    assert util["100000"] == pytest.approx(100000 / 512 * util["512"], rel=1e-3)
    printed = capsys.readouterr()
    assert "cannot serve the control plane while training" in printed.err
    printed = printed.out
    assert "[assumed]" in printed and "[measured here]" in printed
    assert "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP (12500 ranks)" in printed
    # what the projection takes the code to do, said as plainly as the unit costs: keeping
    # unbroken communicators on NCCL is assumed, not built (World.keep is gloo only)
    said = {b["name"]: b["status"] for b in result["behaviour_at_scale"]}
    assert said["groups_kept_on_nccl"] == "assumed, not implemented"
    assert "groups_kept_on_nccl [assumed, not implemented]" in printed


def _laws(op_s=None):
    units = sim_scale.units()
    if op_s is not None:
        units = [sim_scale.Unit(u.name, op_s, u.unit, u.status, u.source)
                 if u.name == "store_server_op_s" else u for u in units]
    plans = sim_scale.plans_for((512, 4096, 100000), 4, 8, 4, log=None)
    return sim_scale.phase_laws(sim_measured.load_measured(MEASURED)["runs"], plans, units)


def test_the_store_server_serves_every_ranks_operations_one_after_another():
    """The job's store term grows as W and as the server's time per operation; the count
    law's own terms do not grow (their counts are bounded, never extrapolated)."""
    laws = _laws()
    key = "store_server (every rank's operations)"
    small, big = laws["rendezvous"].terms(4096), laws["rendezvous"].terms(100000)
    assert big[key] == pytest.approx(small[key] * 100000 / 4096)
    assert big["count_law"] == small["count_law"]
    ops = dict(laws["rendezvous"].counted())["store_ops"]
    u = laws["rendezvous"].unit
    assert big[key] == pytest.approx(100000 * ops * u["store_server_op_s"])
    assert _laws(op_s=2 * u["store_server_op_s"])["rendezvous"].terms(100000)[key] \
        == pytest.approx(2 * big[key])
    for ph in ("detect", "abort", "first_step"):
        assert laws[ph](512) == laws[ph](100000)


def test_the_rounds_records_land_on_the_node_stores_and_do_not_grow_with_w():
    """Issue 57: the restore's rounds and the keep votes are on the node record stores: the
    busiest node's store serves its ranks and their children (gpus per node x (1 + FANOUT)
    ranks), the same at 4,096 and 100,000 GPUs; what is left on the job's store is what the
    runs with the node stores measured (none in the restore)."""
    from megatron_deadpool.mirror.rounds import FANOUT, MAX_OPS_PER_ROUND

    laws = _laws()
    restore, rebuild = laws["restore_state"], laws["rebuild_groups"]
    u = restore.unit
    busiest = "record stores (the busiest node's)"
    assert restore.terms(100000)[busiest] == restore.terms(4096)[busiest] == pytest.approx(
        4 * (1 + FANOUT) * u["restore_record_store_ops"] * u["store_server_op_s"])
    assert restore.terms(100000)["store_server (every rank's operations)"] == pytest.approx(
        100000 * u["restore_job_store_ops"] * u["store_server_op_s"])
    split = sim_scale.load_split()
    assert u["restore_job_store_ops"] == split["restore_state"]["store_ops"]
    assert u["restore_record_store_ops"] == split["restore_state"]["record_store_ops"] > 0
    terms = rebuild.terms(100000)
    # two rounds: the votes (with the descriptions of collectives caught in flight), and
    # when a group was caught so the votes again (recovery/repair.py _complete; the
    # completion test in test_group_repair.py counts them)
    assert u["keep_rounds"] == 2
    assert terms["record stores (keep votes: the busiest node's)"] == pytest.approx(
        4 * (1 + FANOUT) * 2 * MAX_OPS_PER_ROUND * u["store_server_op_s"])
    plan = sim_scale.plans_for((100000,), 4, 8, 4, log=None)[100000]
    kept = plan["members_total"] - plan["rebuilt_members_total"]
    assert terms["record stores (keep votes: the round's bytes at the root's node)"] == \
        pytest.approx(2 * kept * sim_scale.top_share(100000, 4) * u["keep_round_bytes_per_group"]
                      / u["store_server_bytes_s"])
    assert 1.7 < sim_scale.top_share(100000, 4) < 1.9  # 4 ranks' children: ~1.75 W below them


def test_the_rendezvous_serves_each_survivor_a_delta_and_each_spare_the_plan():
    """Every survivor reads the plan's delta (a few hundred bytes), each promoted spare the
    whole plan: the bytes the store serves grow as W, not W^2."""
    small, big = (sim_scale.plan_read_bytes(w, 4) for w in (10000, 100000))
    assert big < 12 * small
    assert sim_scale.plan_read_bytes(100000, 4) < 100000 * 1200


def test_the_committed_plan_is_the_codes_own():
    """docs/data/megatron_group_plans.json is what the code computes (W = 512 again here),
    not a hand-written table."""
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.group_plan", "--world",
                        "512", "--tp", "4", "--pp", "8"], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    want = json.loads(sim_scale.PLANS_FILE.read_text())["plans"]["W512.TP4.PP8.G4"]
    for d in (got, want):
        d.pop("enumerate_s")
    assert got == want


def test_a_missing_plan_is_computed_once_and_cached(tmp_path, capsys):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = ["sim", "--gpus", "64", "128", "--tp", "2", "--pp", "2",
                "--json", str(tmp_path / "a.json")]
        assert main(args) == 0
        first = capsys.readouterr().err
        assert main(args) == 0
        second = capsys.readouterr().err
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    # each GPU count's plan with the grad stats staged (the model's default) and not
    assert first.count("computing it") == 4 and "computing it" not in second
    cached = json.loads((tmp_path / "megatron-deadpool" / "group_plans.json").read_text())
    assert set(cached["plans"]) == {"W64.TP2.PP2.G4", "W128.TP2.PP2.G4",
                                    "W64.TP2.PP2.G4.staged", "W128.TP2.PP2.G4.staged"}
    assert got_other(tmp_path / "a.json") > 0
    got = json.loads((tmp_path / "a.json").read_text())
    # the largest a survivor rebuilds at TP2 x PP2 x DP16: TP x DP (no group of every rank)
    assert got["plans"]["64"]["busiest_survivor_groups"][-1]["size"] == 32


def got_other(path) -> float:
    """The other grad stats' projection (world, beside the default staged) at 64 GPUs."""
    got = json.loads(Path(path).read_text())["grad_stats_other"]
    assert got["grad_stats"] == "world", got
    return got["lost_per_failure_s"]["64"]


def test_a_layout_the_world_does_not_divide_is_refused():
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.group_plan", "--world",
                        "100", "--tp", "8", "--pp", "2"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "must be a multiple of TP x PP (16)" in p.stderr
    with pytest.raises(sim.SimError):
        sim.SimConfig(gpus=(100,), tp=8, pp=2)


def test_the_store_rate_counts_every_clients_operations():
    from megatron_deadpool.apps import store_rate

    got = store_rate.rate(clients=2, n=400)
    assert got["ops"] == 800 and got["clients"] == 2 and got["ops_per_s"] > 0
    with pytest.raises(ValueError):
        store_rate.rate(clients=0)


def test_nccl_unique_ids_are_counted_as_torch_reads_them():
    """torch's initNCCLComm: a group of n > 128 ranks is made from ceil(n / 128) roots'
    128-byte unique ids, every member reading all of them from the store; at or below 128,
    one id. At 100,000 GPUs the world-sized group alone is 100,000 x 782 x 128 bytes."""
    from megatron_deadpool.apps import sim_scale

    u = {"nccl_ranks_per_root": 128.0, "nccl_unique_id_bytes": 128.0}
    assert sim_scale.unique_id_bytes([100], u) == 100 * 128
    assert sim_scale.unique_id_bytes([129], u) == 129 * 2 * 128
    assert sim_scale.unique_id_bytes([100000, 4], u) == (100000 * 782 + 4) * 128
