"""The peer benchmark's injector and log parsing (apps/peer_inject.py, apps/peer_log.py),
fast: dummy "nodes" (a parent and a child process each, tagged in their environment) that
print Megatron-style iteration lines; the injector must kill exactly one node's processes
when iteration K starts, and the parser must read recovery time, redone iterations, lost
time and save cost from captured log text."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_deadpool.apps import peer_log
from megatron_deadpool.apps.peer_inject import Injector, RunLogWriter, node_pids

NODE = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for i in range(1, 400):
        if sys.argv[1] == "1":  # the node whose line the injector reads
            print(f" [t] iteration {i:8d}/     400 | lm loss: 1.0", flush=True)
        time.sleep(0.02)
    child.kill()
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def nodes():
    procs = [subprocess.Popen([sys.executable, "-c", NODE, str(n)], stdout=subprocess.PIPE,
                              text=True,
                              env=dict(os.environ, PEERS_NODE=str(n), RANK=str(2 * n)))
             for n in range(3)]
    yield procs
    for n, p in enumerate(procs):
        for pid in _pids_of(procs, n):
            os.kill(pid, 9)
        p.wait()


def _pids_of(procs, node):
    return node_pids([p.pid for p in procs], "PEERS_NODE", str(node))


def test_injector_kills_exactly_one_node_when_iteration_k_starts(tmp_path, nodes):
    deadline = time.time() + 10
    while (any(len(_pids_of(nodes, n)) < 2 for n in range(3))
           and time.time() < deadline):
        time.sleep(0.02)  # each node: its parent and its child, all started
    before = {n: _pids_of(nodes, n) for n in range(3)}
    assert all(len(v) == 2 for v in before.values()), before
    # the victim named by a rank on it (RANK=4: node 2), as the benchmark does
    inj = Injector(at_iter=5, key="PEERS_NODE", rank=4, roots=lambda: [p.pid for p in nodes])
    w = RunLogWriter(str(tmp_path / "run.log"), injector=inj)
    w.mark("start", attempt=1)
    w.follow(nodes[1].stdout)
    deadline = time.time() + 5
    while inj.fired is None and time.time() < deadline:
        time.sleep(0.02)
    assert inj.fired is not None, "the injector never fired"
    assert sorted(inj.fired["pids"]) == before[2]
    time.sleep(0.3)
    assert not any(_alive(p) for p in before[2])
    assert all(_alive(p) for n in (0, 1) for p in before[n])
    for pid in _pids_of(nodes, 1):
        os.kill(pid, 9)  # its child holds the pipe too
    w.close()
    log = peer_log.parse((tmp_path / "run.log").read_text())
    _, fields = log.first("kill")
    assert fields["iter"] == "5" and fields["node"] == "PEERS_NODE=2"
    n_before = log.seen[[e for _, e, _ in log.markers].index("kill")]
    assert log.iterations[n_before - 1][1] == 4  # fired on K-1's line, before K's


def test_injector_refuses_k_below_2_and_an_ambiguous_victim():
    with pytest.raises(ValueError):
        Injector(at_iter=1, key="PEERS_NODE", value="1", roots=list)
    with pytest.raises(ValueError):
        Injector(at_iter=3, key="PEERS_NODE", value="1", rank=2, roots=list)


def _log(lines):
    return "\n".join(lines) + "\n"


def _it(t, i, total=10):
    return f"{t:.3f}  [2026-11-27 01:00:00] iteration {i:8d}/{total:8d} | lm loss: 1.0"


def _saved(t, i):
    return f"{t:.3f}   successfully saved checkpoint from iteration {i:7d} to /ck [ t 1/2, p 1/2 ]"


FREE = _log([peer_log.marker(0.0, "start", attempt=1)]
            + [_it(10 + i, i) for i in range(1, 5)]
            + [_saved(14.5, 4)]                        # a save after 4: 4 -> 5 takes 1.5 s
            + [_it(15.5 + (i - 5), i) for i in range(5, 11)]
            + [_saved(21.0, 10), peer_log.marker(21.5, "exit", rc=0)])

# killed when 7 started (6 was logged at 16.5); relaunched; resumed from the save at 4
FAILED = _log([peer_log.marker(0.0, "start", attempt=1)]
              + [_it(10 + i, i) for i in range(1, 5)] + [_saved(14.5, 4)]
              + [_it(15.5, 5), _it(16.5, 6), peer_log.marker(16.6, "kill", iter=7, node="x=1",
                                                            pids="1,2"),
                 peer_log.marker(18.0, "start", attempt=2)]
              + [_it(40.0 + (i - 5), i) for i in range(5, 11)]
              + [_saved(46.0, 10), peer_log.marker(46.5, "exit", rc=0)])


def test_failure_run_metrics():
    free, failed = peer_log.parse(FREE), peer_log.parse(FAILED)
    r = peer_log.failure_run(failed, free, train_iters=10)
    assert r["killed"] and r["kill_iteration"] == 7
    assert r["recovery_s"] == pytest.approx(40.0 - 16.6)
    assert r["first_after"] == 5 and r["redone"] == 2  # 5 and 6 were done twice
    assert r["lost_s"] == pytest.approx((45.0 - 11.0) - (20.5 - 11.0))
    assert r["relaunches"] == 1


def test_hot_swap_redoes_nothing():
    failed = FREE.replace(_it(16.5, 6), _it(16.5, 6) + "\n"
                          + peer_log.marker(16.6, "kill", iter=7, node="x=1", pids="3"))
    failed = failed.replace(_it(17.5, 7), _it(18.4, 7)).replace(_it(20.5, 10), _it(21.4, 10))
    r = peer_log.failure_run(peer_log.parse(failed), peer_log.parse(FREE), train_iters=10)
    assert r["redone"] == 0 and r["first_after"] == 7
    assert r["recovery_s"] == pytest.approx(18.4 - 16.6)
    assert r["lost_s"] == pytest.approx(0.9)


def test_free_run_costs_separate_the_save():
    c = peer_log.free_run_costs(peer_log.parse(FREE), train_iters=10)
    assert c["iteration_s"] == pytest.approx(1.0)
    assert c["save_s"] == pytest.approx(0.5)
    assert c["free_span_s"] == pytest.approx(20.5 - 11.0)  # iteration 1's end to the last's


def test_parse_ignores_unstamped_and_prefixed_lines():
    log = peer_log.parse("garbage\n12.000 n3 r7 | iteration        3/      10 | x\n")
    assert log.iterations == [(12.0, 3)]


def test_young_interval_and_summary():
    assert peer_log.young_interval_s(2.0, 3600.0) == pytest.approx(120.0)
    s = peer_log.summarize([3.0, None, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)


def _record(system, lost, bitwise, save=None):
    return {"system": system, "recovery_s": lost / 2, "redone": 0 if system == "deadpool"
            else 2, "lost_s": lost, "iteration_s": 0.5, "save_s": save, "bitwise": bitwise,
            "cpu_s": 0.6, "cpu_by_role": {"worker": 0.5, "control": 0.1, "total": 0.6}}


def test_summary_ratio_young_and_table():
    from megatron_deadpool.apps import bench_peers

    records = [_record("deadpool", x, True) for x in (2.0, 4.0, 3.0)]
    records += [_record("relaunch", x, False, save=2.0) for x in (30.0, 60.0, 45.0)]
    s = bench_peers.summarize(records, ["deadpool", "relaunch"], mtbf_s=3600.0)
    assert s["deadpool"]["lost_s"]["median"] == 3.0 and s["deadpool"]["bitwise"] == "3/3"
    assert s["relaunch"]["lost_ratio_to_deadpool"] == pytest.approx(15.0)
    assert s["relaunch"]["young_interval"]["s"] == pytest.approx(120.0)
    assert s["relaunch"]["young_interval"]["iterations"] == 240
    # modeled: the restart (45 s lost less 2 redone iterations of 0.5 s) + 120 of 0.5 s
    assert s["relaunch"]["young_interval"]["lost_s_modeled"] == pytest.approx(45 - 1 + 60)
    assert "young_interval" not in s["deadpool"]  # no saves to size
    for r in records:
        r["free_span_s"] = 50.0
    per_run = bench_peers.summarize(records, ["relaunch"], mtbf_s=None)["relaunch"]
    assert per_run["young_interval"]["s"] == pytest.approx((2 * 2.0 * 50.0) ** 0.5)
    cfg = {"runs": 3, "kill_iter": 12, "train_iters": 20, "kill_rank": 2, "save_interval": 5,
           "mtbf_s": 3600.0}
    table = bench_peers.markdown({"summary": s, "config": cfg})
    row = next(x for x in table.splitlines() if x.startswith("| relaunch"))
    assert "45.00 (30.00–60.00)" in row and "| 15.0 |" in row and "0/3" in row
    assert "| 0.600 (0.600–0.600) |" in row
    assert s["relaunch"]["cpu_by_role"] == {"worker": 0.5, "spare": None, "control": 0.1,
                                            "total": 0.6}


def test_local_saves_count_once_per_save():
    text = _log([_it(1.0, 1), "1.500 INFO:root:Successfully saved local checkpoint from "
                 "iteration 1", "1.510 INFO:root:Successfully saved local checkpoint from "
                 "iteration 1", "1.520   [x] successfully saved local checkpoint from "
                 "iteration       1", _it(2.5, 2), _it(3.0, 3)])
    log = peer_log.parse(text)
    assert log.saves == [(1.5, 1)]


def _checkpoint(root, step, weight):
    import io

    import torch
    import torch.distributed.checkpoint as dcp

    groups = io.BytesIO()
    torch.save([{"param_groups": [{"lr": 1e-3, "step": step}]}], groups)
    groups.seek(0)
    d = root / "iter_0000004"
    dcp.save({"decoder.weight": torch.full((4,), weight),
              "optimizer.distributed.dp_group_idx_0.optimizer": groups},
             storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    return root


def test_fingerprint_sees_tensors_and_the_optimizer_step(tmp_path):
    """One fingerprint for every system: a different weight or Adam step count (an object,
    not a tensor) changes it; the same state gives the same one; no checkpoint, None."""
    from megatron_deadpool.apps.bench_peers import fingerprint, optimizer_steps

    a = _checkpoint(tmp_path / "a", 4.0, 1.0)
    assert [s for _, _, s in optimizer_steps(str(a / "iter_0000004"))] == [4.0]
    same = fingerprint(str(_checkpoint(tmp_path / "b", 4.0, 1.0)), 4)
    assert fingerprint(str(a), 4) == same and same
    assert fingerprint(str(_checkpoint(tmp_path / "c", 2.0, 1.0)), 4) != same
    assert fingerprint(str(_checkpoint(tmp_path / "d", 4.0, 1.5)), 4) != same
    assert fingerprint(str(a), 8) is None


def _peers_file(tmp_path, pieces=True):
    import json

    def s(med):
        return {"median": med, "min": med, "max": med, "n": 5}

    def system(rec, redone, other, load):
        out = {"recovery_s": s(rec), "redone": s(redone), "iteration_s": s(0.4),
               "save_s": s(2.0), "lost_s": s(rec + 1)}
        if pieces:
            out["pieces"] = {"other_s": other, "init_s": 4.0, "build_s": 0.5,
                             "load_s": load, "data_s": 0.8}
        return out

    summary = {"deadpool": system(1.7, 0, 1.2, 0.0), "nvrx": system(14.0, 2, 8.0, 1.7),
               "nvrx-local": system(30.0, 2, 20.0, 0.5),
               "relaunch": system(40.0, 2, 31.0, 1.7)}
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"summary": summary}))
    return path


def test_restart_pieces_read_from_megatron_timers():
    """A restart's start-up, split by Megatron-LM's own prints after the kill."""
    text = _log([peer_log.marker(0.0, "start", attempt=1), _it(1.0, 1), _it(2.0, 2),
                 _it(3.0, 3), peer_log.marker(3.1, "kill", iter=4, node="x=1", pids="3"),
                 peer_log.marker(3.5, "start", attempt=2),
                 "20.0 time to initialize megatron (seconds): 4.000",
                 "22.0     load-checkpoint ................................: (10.5, 1500.0)",
                 "22.1     model-and-optimizer-setup ......................: (90.0, 2000.0)",
                 "22.2     train/valid/test-data-iterators-setup ..........: (1.0, 800.0)",
                 _it(23.1, 3), _it(24.1, 4)])
    log = peer_log.parse(text)
    p = peer_log.restart_pieces(log, 3.1, 23.1, 1.0)
    assert p["init_s"] == 4.0 and p["load_s"] == 1.5 and p["build_s"] == 0.5
    assert p["data_s"] == 0.8
    assert abs(p["other_s"] - (20.0 - 4.0 - 1.5 - 0.5 - 0.8 - 1.0)) < 1e-9
    prefixed = text.replace("22.0     load", "22.0 [n3 r7]     load").replace(
        "22.1     model", "22.1 [n3 r7]     model")  # a `deadpool launch` worker's lines
    assert peer_log.restart_pieces(peer_log.parse(prefixed), 3.1, 23.1, 1.0) == p
    hot = peer_log.restart_pieces(peer_log.parse(_log([_it(5.0, 5)])), 1.0, 5.0, 1.0)
    assert hot == {"init_s": 0.0, "load_s": 0.0, "build_s": 0.0, "data_s": 0.0,
                   "other_s": 3.0}


def test_sim_peers_projects_each_system_at_each_scale(tmp_path):
    from megatron_deadpool.apps import sim, sim_peers

    cfg = sim.SimConfig()
    peers = sim_peers.load_pieces(_peers_file(tmp_path))
    result = sim_peers.project(cfg, sim_peers_measured(), peers)
    assert list(result["per_scale"]) == ["512", "4096", "100000"]
    for v in result["per_scale"].values():
        row = v["systems"]
        assert set(row) == set(sim_peers.SYSTEMS)
        assert row["deadpool"]["lost_ratio_to_deadpool"] == 1.0
        # the measured pieces are used as measured; the scale costs are the assumptions
        assert row["relaunch"]["parts"]["start_measured_s"] == 31.0
        assert row["relaunch"]["parts"]["requeue_s"] == 300.0
        assert row["nvrx"]["parts"]["requeue_s"] == 0.0
        assert row["relaunch"]["lost_s"] - row["nvrx"]["lost_s"] == \
            300.0 + 31.0 - 8.0
        for x in row.values():
            assert 0.0 <= x["goodput"] <= 1.0
    table = "\n".join(sim_peers.format_table(result))
    assert "nvrx-local" in table and "100000" in table


def sim_peers_measured():
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent / "docs" / "data" / "bench_recovery.json")


def test_sim_peers_refuses_a_file_without_pieces(tmp_path):
    from megatron_deadpool.apps import sim_peers
    from megatron_deadpool.base.errors import DeadpoolError

    with pytest.raises(DeadpoolError, match="no restart pieces"):
        sim_peers.load_pieces(_peers_file(tmp_path, pieces=False))
    with pytest.raises(DeadpoolError, match="not found"):
        sim_peers.load_pieces(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DeadpoolError, match="not a bench peers result"):
        sim_peers.load_pieces(tmp_path / "bad.json")


def test_deadpool_sim_peers_cli(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "sim", "--peers",
                        str(_peers_file(tmp_path))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "deadpool" in r.stdout and "relaunch" in r.stdout and "4096" in r.stdout


BUSY = "import time\nt = time.time() + 0.6\nwhile time.time() < t: pass\ntime.sleep(60)"


def test_cpu_probe_sums_the_jobs_cpu_by_role(tmp_path):
    """Three busy processes under one root: a worker (RANK and LOCAL_RANK), a DeadPool
    standby spare and a launcher-like one; the probe's samples, taken on iteration lines,
    give each its own role and grow by the CPU they burned in between."""
    from megatron_deadpool.apps.peer_inject import CpuProbe, RunLogWriter, role_of

    envs = [dict(os.environ, RANK="0", LOCAL_RANK="0"), dict(os.environ, DEADPOOL_ROLE="spare"),
            {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}]
    procs = [subprocess.Popen([sys.executable, "-c", BUSY], env=e) for e in envs]
    try:
        assert [role_of(p.pid) for p in procs] == ["worker", "spare", "control"]
        probe = CpuProbe((2, 4), roots=lambda: [p.pid for p in procs])
        writer = RunLogWriter(str(tmp_path / "run.log"), probe=probe)
        writer.line(_it(0, 2).partition(" ")[2])
        writer.line(_it(0, 3).partition(" ")[2])  # not sampled
        time.sleep(1.0)  # each burns its 0.6 s of CPU
        writer.line(_it(0, 4).partition(" ")[2])
        writer.line(_it(0, 4).partition(" ")[2])  # a second line of 4: sampled once
        writer.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    log = peer_log.parse((tmp_path / "run.log").read_text())
    assert log.count("cpu") == 2
    cpu = peer_log.cpu_per_iteration(log)
    for role in ("worker", "spare", "control"):  # 2 iterations apart
        assert 0.05 < cpu[role] <= 0.35, cpu
    assert cpu["total"] == pytest.approx(cpu["worker"] + cpu["spare"] + cpu["control"])


def test_cpu_per_iteration_reads_the_first_two_samples():
    text = "\n".join([peer_log.marker(1.0, "cpu", iter=2, worker="10.0", spare="1.0",
                                      control="0.5"),
                      peer_log.marker(9.0, "cpu", iter=12, worker="30.0", spare="1.5",
                                      control="2.5")])
    cpu = peer_log.cpu_per_iteration(peer_log.parse(text))
    assert cpu == pytest.approx({"worker": 2.0, "spare": 0.05, "control": 0.2,
                                 "total": 2.25})
    assert peer_log.cpu_per_iteration(peer_log.parse(text.splitlines()[0])) == {}
    c = peer_log.free_run_costs(peer_log.parse(FREE + "\n" + text), train_iters=10)
    assert c["cpu_s"] == pytest.approx(2.25) and c["cpu_by_role"]["worker"] == 2.0


def test_a_lost_time_within_noise_of_zero_divides_by_the_recovery_time():
    from megatron_deadpool.apps import bench_peers

    records = [dict(_record("deadpool", x, True), recovery_s=1.25) for x in (-0.8, -0.4, 1.5)]
    records += [_record("relaunch", x, False, save=2.0) for x in (30.0, 60.0, 45.0)]
    s = bench_peers.summarize(records, ["deadpool", "relaunch"], mtbf_s=3600.0)
    assert s["deadpool"]["lost_s"]["median"] == -0.4
    assert s["deadpool"]["ratio_reference_s"] == 1.25
    assert s["relaunch"]["lost_ratio_to_deadpool"] == pytest.approx(45.0 / 1.25)
    assert s["deadpool"]["lost_ratio_to_deadpool"] is None  # its own median is below zero


def test_deadpool_slurm_submits_the_batch_script_requeueable_with_the_jobs_flags(tmp_path):
    """``deadpool-slurm``: cpu-local.sbatch, requeueable, appending its output across the
    requeue, one run id per job name, the shared job's flags with the final --save and a
    --load; --deadpool and the fallback flags come from the batch script
    (DEADPOOL_REQUEUE), not from the benchmark; the kill finds a node by its Slurm name."""
    from megatron_deadpool.apps import peer_systems as ps

    job = ps.PeerJob(tree="/t", python="/p/python", flags=["--train-iters", "20"],
                     train_iters=20, save_interval=5)
    argv = ps.system_flags("deadpool-slurm", job, "CK", "LOCAL")
    assert "--deadpool" not in argv and "--deadpool-fallback-save" not in argv
    assert argv[argv.index("--load") + 1] == "CK" and "--save" in argv
    cmd, env, log = ps.slurm_job(job, argv, str(tmp_path), "peers-x")
    assert cmd[0] == "sbatch" and {"--wait", "--requeue", "--open-mode=append"} <= set(cmd)
    assert cmd[-1].endswith("scripts/cpu-local.sbatch") and os.path.exists(cmd[-1])
    assert f"--nodes={job.nodes}" in cmd and f"--output={log}" in cmd
    assert env["DEADPOOL_REQUEUE"] == "1" and env["TRAINER_FLAGS"].split() == argv
    assert env["PROCS_PER_NODE"] == "2" and env["ACTIVE_NODES"] == "4"
    assert ps.node_tag("deadpool-slurm") == "SLURMD_NODENAME"
    assert ps.node_tag("deadpool-nvrx") == "DEADPOOL_NODE"
    assert ps.node_tag("nvrx-local") == ps.NODE_TAG
