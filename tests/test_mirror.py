"""Mirror must-shows: a rank's state comes back from its buddy's copy in another process."""

import json

import pytest

from conftest import deadpool, launch, layout_flags

pytestmark = [pytest.mark.slow]


# CI: the TP2.PP2.DP2 case (the other two run in `make test-all`; CI time, see .ci/run)
@pytest.mark.parametrize("tp,pp,victim", [(2, 2, 5),
                                          (1, 4, 3), (1, 1, 6)])
def test_rank_killed_during_optimizer_restores_from_buddy(tmp_path, reference, tp, pp, victim):
    """Rank `victim` dies inside its optimizer step at iteration 7 (others may already have
    stepped). Every survivor rolls back to the committed iteration from its local snapshot;
    the victim's state comes from its buddy's host memory into a fresh spare process."""
    flags = layout_flags(tp, pp, 12)
    ref = reference(flags)
    p, s = launch(tmp_path, flags + ["--deadpool"], spares=1,
                  inject=[f"kill:rank={victim}@iter=7,phase=optimizer"])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [victim]
    assert rec["spare_of_rank"] == {str(victim): 8}
    assert rec["restored_iter"] in (5, 6) and rec["recomputed_iters"] <= 1
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    assert s["losses"] == ref["losses"]
    m = s["mirror"]
    assert m["host_bytes_per_rank"] <= 4 * m["mirror_bytes_per_rank"]


# Not in CI (109 s there): a benchmark's output fields; `make test-all` runs it.
def test_bench_overhead_prints_and_writes_fields(tmp_path):
    out = tmp_path / "o.json"
    p = deadpool(["bench", "overhead", "--json", str(out), "--rounds", "1",
                  "--in-run-iters", "15", "--",
                  *layout_flags(2, 2, 8)], cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    for k in ("step_s_off", "step_s_on", "ratio_on_over_off", "mirror_bytes_per_rank",
              "host_bytes_per_rank", "waits"):
        assert k in d, k
    assert d["ratio_on_over_off"] == pytest.approx(d["step_s_on"] / d["step_s_off"])
    assert d["host_bytes_per_rank"] <= 4 * d["mirror_bytes_per_rank"]
    # K = 1: 4 slots (2 own, 2 of the buddy's, whose shard may differ); a slot is the
    # shard plus a header and the metadata area
    assert d["replicas"] == 1 and d["host_bytes_bound_over_shard"] == 4
    shards = d["host_bytes_over_shard_all"]
    assert len(shards) == 8 and d["host_bytes_over_shard"] == max(shards)
    assert 2 < min(shards) and max(shards) < 8  # buddy shards here < 2 x a rank's own
    assert d["pinned_bytes_per_rank"] == 0  # CPU: nothing is pinned
    assert "ratio_on_over_off" in p.stdout and "x shard" in p.stdout
    ir = d["in_run"]
    assert ir["steps_on"] > 0 and ir["steps_off"] > 0
    assert ir["ratio_on_over_off"] == pytest.approx(ir["step_s_on"] / ir["step_s_off"])
    # the CPU cost from per-thread clocks: one mirror-on run, max over its 8 ranks
    assert d["mirror_cpu_fraction_runs"] == [d["mirror_cpu_fraction"]]
    assert d["mirror_cpu_fraction"] > 0 and ir["mirror_cpu_fraction"] > 0
    # megatron-core's step all-reduces the grad norm over the world: no commit collective
    assert d["mirror_commit"] == ["implicit"]
    assert d["mirror_transport"] == ["socket"]  # the default: the mirror's own connections
    assert d["mirror_cpu"][0]["gloo_cpu_per_job_s"] > 0  # the mirror group's threads, found
    assert d["snapshot_gbps"] > 0 and d["copy_gbps"] > 0 and d["checksum_gbps"] > 0
    assert "mirror_cpu_fraction" in p.stdout and "snapshot_gbps" in p.stdout


def test_replicas_zero_on_one_node_trains_like_mirror_off(tmp_path, reference):
    """--deadpool-replicas 0: one node, no buddy, the local snapshot only; the training is
    bitwise the one without DeadPool."""
    flags = layout_flags(2, 1, 5, world=2)
    ref = reference(flags, nodes=1, ppn=2)
    p, s = launch(tmp_path, flags + ["--deadpool", "--deadpool-replicas", "0"], nodes=1, ppn=2)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    m = s["mirror"]
    assert m["host_bytes_per_rank"] == 2 * m["mirror_bytes_per_rank"]
