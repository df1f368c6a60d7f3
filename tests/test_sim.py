"""deadpool sim (apps/sim.py, base/scaling.py, apps/sim_plot.py): the scaling-law fit,
the validation, the goodput and spare formulas, and the command line. Pure and fast: the
measured input is a synthetic file written here (the repo's docs/data file is only checked
for its shape)."""

import json
import math

import pytest

from megatron_deadpool.base import scaling
from megatron_deadpool.apps import sim, sim_measured
from megatron_deadpool.apps.cli import main
from megatron_deadpool.base.vocabulary import PHASE_ORDER

WS = [4, 8, 16]


def _measured(path, totals_by_w=None, placeholder=False, grow=0.002):
    """A bench recovery file: every phase 0.2 s except rebuild_groups, 0.2 + grow x W."""
    runs = []
    for w in WS:
        ph = {p: 0.2 for p in PHASE_ORDER}
        ph["rebuild_groups"] = 0.2 + grow * w
        if totals_by_w and w in totals_by_w:
            ph["first_step"] += totals_by_w[w] - sum(ph.values())
        runs.append({"world_size": w, "total_s_median": sum(ph.values()),
                     "phases_s": {p: {"median": v, "min": v, "max": v} for p, v in ph.items()}})
    path.write_text(json.dumps({"runs": runs, **({"placeholder": True} if placeholder else {})}))
    return str(path)


@pytest.mark.parametrize("form,f", [
    ("O(1)", lambda w: 0.7),
    ("O(log W)", lambda w: 0.3 + 0.05 * math.log2(w)),
    ("O(W)", lambda w: 0.1 + 0.01 * w),
])
def test_fit_recovers_a_known_law(form, f):
    ws = [4, 8, 16, 32]
    law = scaling.fit(ws, [f(w) for w in ws])
    assert law.form == form
    assert law(1000) == pytest.approx(f(1000), rel=1e-6)


def test_fit_keeps_a_constant_against_small_noise_and_never_decreases():
    assert scaling.fit(WS, [0.400, 0.404, 0.401]).form == "O(1)"
    down = scaling.fit(WS, [0.5, 0.4, 0.3])
    assert down.form == "O(1)" and down(100000) == pytest.approx(0.4)
    with pytest.raises(scaling.FitError):
        scaling.fit([4], [])


def test_shard_bytes_by_hand():
    cfg = sim.SimConfig(gpus=(64,), tp=2, pp=4, model_params=8e9)
    # DP 8: 12 B x 8e9 / 64 optimizer shard + 2 B x 8e9 / 8 bf16 params
    assert sim.shard_bytes_per_rank(cfg, 64) == pytest.approx(1.5e9 + 2e9)


def test_validation_flags_a_miss_over_25_percent(tmp_path, capsys):
    good = sim.validate(sim_measured.load_measured(_measured(tmp_path / "g.json"))["runs"],
                        sim.SimConfig())
    assert [v["world_size"] for v in good] == WS
    assert all(v["within_25pct"] and v["method"] == "leave-one-out" for v in good)
    bad_file = _measured(tmp_path / "b.json", totals_by_w={16: 3.0})
    bad = {v["world_size"]: v for v in sim.validate(sim_measured.load_measured(bad_file)["runs"],
                                                     sim.SimConfig())}
    assert not bad[16]["within_25pct"] and bad[16]["rel_error"] < -0.25
    assert bad[16]["measured_total_s"] == pytest.approx(3.0)
    assert main(["sim", "--measured", bad_file]) == 0
    assert "W=16 prediction is off by" in capsys.readouterr().err


def test_goodput_tends_to_one_minus_overheads_without_failures(tmp_path):
    laws = sim.fit_phases(sim_measured.load_measured(_measured(tmp_path / "m.json"))["runs"],
                          sim.SimConfig())
    cfg = sim.SimConfig(node_mtbf_hours=1e15, checkpoint_interval_min=30,
                        checkpoint_write_s=36, mirror_overhead=0.02)
    g = sim.strategies_at(cfg, laws, 4096)["goodput"]
    assert g["hotswap"] == pytest.approx(0.98, abs=1e-6)
    assert g["checkpoint_restart"] == pytest.approx(0.98, abs=1e-6)   # 36 s / 1800 s
    assert g["inprocess_restart"] == pytest.approx(0.98, abs=1e-6)


def test_goodput_ordering_at_default_inputs(tmp_path):
    cfg = sim.SimConfig()
    out = sim.simulate(cfg, _measured(tmp_path / "m.json"))
    g, lost = out["goodput"], out["lost_per_failure_s"]
    for n in ("512", "4096", "100000"):
        assert g["hotswap"][n] >= g["checkpoint_restart"][n]
        assert g["inprocess_restart"][n] >= g["checkpoint_restart"][n]
        assert lost["hotswap"][n] < lost["checkpoint_restart"][n]
    # more GPUs, more failures: goodput falls for every strategy
    for s in sim.STRATEGIES:
        assert g[s]["512"] > g[s]["100000"]
    # a slower link costs hot swap restore time
    slow = sim.simulate(sim.SimConfig(link_gbps=1), _measured(tmp_path / "m.json"))
    assert slow["lost_per_failure_s"]["hotswap"]["512"] > lost["hotswap"]["512"]


def test_spares_monotone_in_target_and_exact():
    counts = [sim.spares_needed(40.0, p)[0] for p in (0.5, 0.9, 0.99, 0.999)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    n, p = sim.spares_needed(3.0, 0.95)
    assert p >= 0.95 > sim.poisson_cdf(n - 1, 3.0)
    brute = sum(math.exp(-3.0) * 3.0 ** i / math.factorial(i) for i in range(n + 1))
    assert p == pytest.approx(brute)
    big = sim.spares(sim.SimConfig(gpus=(100000,), target_probability=0.99))
    assert big["spare_nodes"] > big["per_scale"]["100000"]["expected_failures"]


def test_cli_writes_the_required_keys(tmp_path, capsys):
    f = tmp_path / "s.json"
    assert main(["sim", "--json", str(f), "--measured", _measured(tmp_path / "m.json"),
                 "--spare-nodes", "3"]) == 0
    out = json.loads(f.read_text())
    for key in ("goodput", "lost_per_failure_s"):
        assert set(out[key]) == set(sim.STRATEGIES)
        for s in sim.STRATEGIES:
            assert set(out[key][s]) == {"512", "4096", "100000"}
    assert set(out["scaling_law"]) == set(PHASE_ORDER)
    assert out["scaling_law"]["rebuild_groups"]["form"] == "O(W)"
    assert isinstance(out["spares"]["spare_nodes"], int)
    assert out["spares"]["per_scale"]["512"]["probability_with_given_spares"] > 0
    for v in out["validation"]:
        assert {"world_size", "predicted_total_s", "measured_total_s", "rel_error",
                "within_25pct"} <= set(v)
    assert out["assumptions"]["tp"] == 4 and "measured_file" in out
    assert "hotswap" in capsys.readouterr().out


def test_repo_measured_file_has_the_bench_shape():
    from conftest import REPO

    data = json.loads((REPO / "docs" / "data" / "bench_recovery.json").read_text())
    assert {r["world_size"] for r in data["runs"]} >= {4, 8, 16}
    for r in data["runs"]:  # a phase added since it was measured counts as 0 s (sim_measured)
        assert r["phases_s"] and set(r["phases_s"]) <= set(PHASE_ORDER)
        assert "total_s_median" in r


@pytest.mark.parametrize("flags,msg", [
    (["--gpus", "510"], "not a multiple of --gpus-per-node"),
    (["--gpus", "520", "--tp", "4", "--pp", "8"], "does not divide 520 GPUs"),
    (["--node-mtbf-hours", "0"], "--node-mtbf-hours must be > 0"),
    (["--target-probability", "1"], "--target-probability must be in (0, 1)"),
    (["--measured", "no-such-file.json"], "not found"),
])
def test_bad_input_exits_2_with_a_message(flags, msg, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sim", *flags]) == 2
    assert msg in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["sim", "--measured", _measured(tmp_path / "m.json"),
                 "--plot", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_oversubscription_is_removed_before_fitting(tmp_path):
    """Phases that only grow because W + 2 processes share 2 cores fit as O(1) per process,
    and the validation multiplies the prediction back (exact here)."""
    runs = []
    for w in (4, 8, 16):
        k = (w + 2) / 2
        runs.append({"world_size": w, "processes": w + 2,
                     "phases_s": {ph: 0.05 * k for ph in PHASE_ORDER},
                     "total_s_median": 0.05 * k * len(PHASE_ORDER)})
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"runs": runs, "cpu_cores": 2}))
    measured = sim_measured.load_measured(path)
    cfg = sim.SimConfig()
    laws = sim.fit_phases(measured["runs"], cfg)
    assert all(laws[ph].form == "O(1)" for ph in PHASE_ORDER if ph != "restore_state")
    for e in sim.validate(measured["runs"], cfg):
        assert e["oversubscription"] == (e["world_size"] + 2) / 2
        assert abs(e["rel_error"]) < 1e-3 and e["within_25pct"]


def test_the_spare_pool_is_sized_with_repairs_by_default(tmp_path, capsys):
    """Issue 59: a failed node returns after the repair time (24 h by default, sourced), so
    the pool at 100,000 GPUs is the failures of a day, not of the whole job; the table
    prints the spares per scale and the share of the machine they leave idle."""
    default = sim.spares(sim.SimConfig())
    never = sim.spares(sim.SimConfig(repair_hours=0))
    assert default["window"] == "repair time" and default["window_hours"] == 24
    assert never["window"] == "job length" and never["window_hours"] == 720
    assert default["spare_nodes"] < never["spare_nodes"] / 10
    nodes = 100000 // 4
    assert default["idle_share"] == pytest.approx(
        default["spare_nodes"] / (nodes + default["spare_nodes"]), abs=1e-6)
    assert "DSN 2006" in sim.SimConfig().assumptions()["repair_source"]
    with pytest.raises(sim.SimError):
        sim.SimConfig(repair_hours=-1)
    assert main(["sim", "--law", "fit", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "the machine they leave idle" in out and "100000 GPUs 64 (0.26%)" in out


def test_correlated_failures_take_a_whole_domain_of_spares():
    """A share of the failure events takes a whole domain: N = X + D Y (issue 59)."""
    from megatron_deadpool.apps import sim

    mu = 3.0
    for n in (0, 2, 5, 17, 18, 40):
        assert sim.nodes_lost_cdf(n, mu, 0.0, 18) == sim.poisson_cdf(n, mu)  # none: a node each
        # every event a domain of 18: at most n nodes is at most n // 18 events
        assert abs(sim.nodes_lost_cdf(n, mu, 1.0, 18) - sim.poisson_cdf(n // 18, mu)) < 1e-12
    n, p = sim.spares_needed_correlated(mu, 0.1, 18, 0.99)
    n1, _ = sim.spares_needed(mu, 0.99)
    assert p >= 0.99 > sim.nodes_lost_cdf(n - 1, mu, 0.1, 18) and n > n1
    out = sim.spares(sim.SimConfig(domain_share=0.1))
    top = out["per_scale"]["100000"]
    assert out["domain_share"] == 0.1 and top["spare_nodes"] > \
        sim.spares(sim.SimConfig())["per_scale"]["100000"]["spare_nodes"]
    assert top["spare_nodes_upper_domain"] >= 1


def test_a_domain_share_outside_0_1_is_refused():
    from megatron_deadpool.apps import sim

    for bad in ({"domain_share": -0.1}, {"domain_share": 1.5}, {"domain_nodes": 0}):
        with pytest.raises(sim.SimError):
            sim.SimConfig(**bad)
