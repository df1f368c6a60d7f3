"""deadpool sim's count law (apps/sim_counts.py): phase time = constant + counts x unit
costs, the unit costs fitted by non-negative least squares, projected through each count's
own law against W."""

import json

import pytest

from megatron_deadpool.apps import sim, sim_counts
from megatron_deadpool.base.errors import DeadpoolError
from megatron_deadpool.base.vocabulary import PHASE_ORDER

UNIT = {"connections": 2e-3, "store_ops": 5e-4, "bytes": 1e-8, "groups_created": 1e-2}
CONST = {"abort": 0.05, "rendezvous": 0.2, "rebuild_groups": 0.1, "restore_state": 0.3,
         "first_step": 0.4}


def _counts(w):
    return {"abort": {},
            "rendezvous": {"connections": w - 1, "store_ops": 3 * w},
            "rebuild_groups": {"groups_created": 8, "connections": 12,
                               "store_ops": 4 * w + 10},
            "restore_state": {"bytes": 4096 + 100 * w, "connections": 2},
            "first_step": {}}


def _run(w, oversub=1.0):
    c = _counts(w)
    phases = {ph: oversub * (CONST.get(ph, 0.0) + sum(UNIT[k] * n
                                                      for k, n in c.get(ph, {}).items()))
              for ph in PHASE_ORDER}
    return {"world_size": w, "phases_s": phases, "counts": c, "oversub": oversub,
            "total_s": sum(phases.values())}


def test_nnls_solves_a_nonnegative_system_and_clamps_a_negative_one():
    x = sim_counts.nnls([[1, 0], [0, 1], [1, 1]], [1.0, 2.0, 3.0])
    assert x == pytest.approx([1.0, 2.0], abs=1e-6)
    x = sim_counts.nnls([[1.0], [1.0]], [-1.0, -2.0])
    assert x == [0.0]


def test_unit_costs_come_back_from_phase_times_generated_with_them():
    runs = [_run(w, oversub=w / 2) for w in (4, 8, 16)]
    units = sim_counts.fit_units(runs)
    predicted = [sum(units.phase_s(ph, r["counts"].get(ph, {})) for ph in PHASE_ORDER)
                 * r["oversub"] for r in runs]
    assert predicted == pytest.approx([r["total_s"] for r in runs], rel=1e-3)
    for v in sim_counts.validate(runs, 0.25):
        assert v["within_25pct"] and v["in_sample_within_25pct"], v


def test_a_projection_grows_only_where_a_count_grows():
    laws = sim_counts.phase_laws([_run(w) for w in (4, 8, 16)])
    assert laws["rebuild_groups"].counts["groups_created"].form == "O(1)"
    assert laws["rendezvous"].counts["connections"].form == "O(W)"
    # the constant part stays; the O(W) store ops and connections are what grows
    big = laws["rendezvous"](100000)
    assert big == pytest.approx(CONST["rendezvous"] + UNIT["connections"] * 99999
                                + UNIT["store_ops"] * 300000, rel=0.02)
    assert laws["abort"](100000) == pytest.approx(CONST["abort"], rel=0.02)


def test_the_dead_ranks_groups_counted_apart_are_parts_not_costs():
    """counts.DETAIL (the dead ranks' own groups, groups completed) repeats work counted in
    the kinds: a file that carries them gives the same law, and no unit cost for them (a
    measured file of 7659ff2 made `deadpool sim --measured` fail with a KeyError)."""
    plain = [_run(w) for w in (4, 8, 16)]
    detailed = [_run(w) for w in (4, 8, 16)]
    for r in detailed:
        r["counts"]["rebuild_groups"].update(dead_groups=3, dead_group_connections=12,
                                             dead_group_store_ops=4 * r["world_size"])
    a, b = sim_counts.phase_laws(plain), sim_counts.phase_laws(detailed)
    assert set(b["rebuild_groups"].to_json()["unit_s"]) == \
        set(a["rebuild_groups"].to_json()["unit_s"])
    assert b["rebuild_groups"](100000) == a["rebuild_groups"](100000)


def test_fit_units_refuses_runs_without_counts():
    r = _run(4)
    r["counts"] = None
    with pytest.raises(DeadpoolError, match="--counts"):
        sim_counts.fit_units([r, _run(8)])


def test_simulate_takes_the_count_law_from_a_file_with_counts(tmp_path):
    runs = [dict(_run(w), processes=w + 2,
                 phases_s={ph: {"median": v} for ph, v in _run(w)["phases_s"].items()})
            for w in (4, 8, 16)]
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"runs": runs, "cpu_cores": 64}))
    out = sim.simulate(sim.SimConfig(), f)
    assert out["law"] == "counts"
    assert out["scaling_law"]["rendezvous"]["counts"]["connections"]["form"] == "O(W)"
    assert all(v["within_25pct"] for v in out["validation"])
    assert sim.simulate(sim.SimConfig(), f, law="fit")["law"] == "fit"
    with pytest.raises(sim.SimError):
        sim.simulate(sim.SimConfig(), f, law="guess")
    for r in runs:
        r["counts"] = None
    f.write_text(json.dumps({"runs": runs, "cpu_cores": 64}))
    assert sim.simulate(sim.SimConfig(), f)["law"] == "fit"


def test_unit_costs_timed_one_by_one_fix_the_units_and_leave_only_the_constants():
    runs = [_run(w, oversub=w / 2) for w in (4, 8, 16)]
    units = sim_counts.fit_units(runs, measured=UNIT)
    assert dict(units.unit_s) == {k: UNIT.get(k, 0.0) for k in units.unit_s}
    for ph in PHASE_ORDER:
        assert units.constants_s[ph] == pytest.approx(CONST.get(ph, 0.0), abs=1e-9), ph
    # a unit cost timed too high leaves a negative remainder: the constant is 0, not < 0
    high = sim_counts.fit_units(runs, measured=dict(UNIT, connections=1.0))
    assert high.constants_s["rendezvous"] == 0.0
    assert all(v["within_25pct"] for v in sim_counts.validate(runs, 0.25, UNIT))
    bad = sim_counts.validate(runs, 0.25, dict(UNIT, connections=0.2))
    assert not all(v["within_25pct"] for v in bad)


def test_simulate_reads_the_unit_costs_from_the_measured_file_or_from_units(tmp_path):
    runs = [dict(_run(w), processes=w + 2,
                 phases_s={ph: {"median": v} for ph, v in _run(w)["phases_s"].items()})
            for w in (4, 8, 16)]
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"runs": runs, "cpu_cores": 64, "unit_costs": {"unit_s": UNIT}}))
    out = sim.simulate(sim.SimConfig(), f)
    assert out["unit_costs"].startswith("timed one by one")
    assert out["scaling_law"]["rendezvous"]["unit_s"]["connections"] == UNIT["connections"]
    u = tmp_path / "u.json"
    u.write_text(json.dumps({"unit_s": dict(UNIT, connections=4e-3)}))
    doubled = sim.simulate(sim.SimConfig(), f, units=str(u))
    assert doubled["scaling_law"]["rendezvous"]["unit_s"]["connections"] == 4e-3
    assert doubled["lost_per_failure_s"]["hotswap"]["100000"] > \
        out["lost_per_failure_s"]["hotswap"]["100000"]
    u.write_text("not json")
    with pytest.raises(DeadpoolError, match="--units"):
        sim.simulate(sim.SimConfig(), f, units=str(u))
    f.write_text(json.dumps({"runs": runs, "cpu_cores": 64}))
    assert sim.simulate(sim.SimConfig(), f)["unit_costs"] == "fitted to the phase times"
