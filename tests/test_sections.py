"""Long, legitimate phases are not hangs: a rank's progress is judged by its current
section's timeout (startup, step, save, eval, data), and in a section that may hold the GIL
a stale heartbeat too. Pure tests of the policy (the decider's injected clock), of the
worker's section tracking and the flags; a fact about the GIL that the policy rests on; and
two real jobs: a save 4x the step timeout is not fenced, a rank stopped in its save is
fenced after the save section's timeout."""

import ctypes
import re
import threading
import time

import pytest
import torch.distributed as dist

from megatron_deadpool.base.config import DeadpoolConfig, DeciderConfig
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.decider import Decider, Proc
from megatron_deadpool.adapters.lm_rules import mark_sections
from megatron_deadpool.base.sections import SectionTracker, parse_section_timeouts

from conftest import launch
from test_decider import Clock

STEP_S, SAVE_S, HB_S = 2.0, 20.0, 1.0


def _job():
    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(4)}
    procs[4] = Proc(lid=4, node=2, role="spare")
    cmds, clock, logs = [], Clock(), []
    cfg = DeciderConfig(heartbeat_timeout_s=HB_S, heartbeat_interval_s=0.1, grace_s=0.0,
                        progress_timeout_s=STEP_S,
                        section_timeouts_s={"startup": 30.0, "save": SAVE_S, "eval": 30.0,
                                            "data": 30.0})
    d = Decider(store=store, procs=procs, world_size=4, token="secret",
                send_command=lambda node, cmd: cmds.append((node, cmd)), config=cfg,
                log=logs.append, clock=clock)
    d.publish_initial_plan()
    coord = st.Coordinator(store, "secret")
    for lid in range(5):
        coord.push_event("join", lid=lid, nonce=f"n{lid}")
    return d, coord, cmds, clock, logs


class Ranks:
    """Heartbeats of every process, 0.1 s of the injected clock apart, the decider stepped
    after each: a rank trains (a new iteration per beat, in the step section) unless it is
    held in a section (``hold``: no new iteration) or stopped (no heartbeat at all)."""

    def __init__(self, d, coord, clock):
        self.d, self.coord, self.clock = d, coord, clock
        self.seq, self.stopped, self.held = 0, set(), {}
        self.iteration = {lid: 1 for lid in range(5)}

    def hold(self, lid, section, n):
        self.held[lid] = (section, n)

    def run(self, seconds):
        for _ in range(round(seconds / 0.1)):
            self.seq += 1
            for lid in set(self.iteration) - self.stopped:
                section, n = self.held.get(lid, ("step", 1))
                if lid not in self.held:
                    self.iteration[lid] += 1
                it = self.iteration[lid]
                self.coord.beat(lid, seq=self.seq, iteration=it, state="ACTIVE",
                                committed=it - 1, gen=0, section=section, section_n=n)
            self.clock.advance(0.1)
            self.d.step()


def _fenced(cmds):
    return [c["lids"][0] for _, c in cmds if c.get("signal") == "SIGKILL"]


def test_a_save_4x_the_step_timeout_is_not_fenced():
    d, coord, cmds, clock = _job()[:4]
    r = Ranks(d, coord, clock)
    r.run(1.0)
    for lid in range(4):  # every rank saves: no new iteration for 4x the step timeout
        r.hold(lid, "save", 2)
    r.run(4 * STEP_S)
    assert _fenced(cmds) == [] and d.gen == 0
    for lid in range(4):  # the save ends (progress); the step section's clock runs again
        r.hold(lid, "step", 3)
    r.run(STEP_S * 0.8)
    assert _fenced(cmds) == [] and d.gen == 0
    r.run(STEP_S)  # and a step that does not advance is fenced after the step timeout
    assert sorted(_fenced(cmds)) == [0, 1, 2, 3]


def test_a_save_longer_than_the_save_timeout_is_fenced():
    d, coord, cmds, clock, logs = _job()
    r = Ranks(d, coord, clock)
    r.hold(2, "save", 2)
    r.run(SAVE_S - 1)
    assert _fenced(cmds) == []
    r.run(2)
    assert _fenced(cmds) == [2]
    assert any(re.search(r"no progress for [\d.]+s in section save \(timeout 20s\)", m)
               for m in logs), logs


def test_a_rank_stopped_in_its_save_is_fenced_after_the_save_timeout_not_before():
    """SIGSTOP inside a save: its heartbeat goes stale, which in a section that may hold the
    GIL is judged by that section's timeout, not the heartbeat (or step) timeout."""
    d, coord, cmds, clock, logs = _job()
    r = Ranks(d, coord, clock)
    r.run(0.5)
    r.hold(3, "save", 2)
    r.run(0.3)  # the decider saw it enter its save
    r.stopped.add(3)
    r.run(SAVE_S - 1)  # the others go on training meanwhile
    assert _fenced(cmds) == [] and d.gen == 0  # past the heartbeat and the step timeouts
    r.run(2.0)
    assert _fenced(cmds) == [3] and d.gen == 1 and d.plans[-1].failed_ranks == (3,)
    assert any("in section save (timeout 20s)" in m for m in logs), logs


def test_ranks_waiting_for_a_rank_stopped_in_its_save_are_not_blamed():
    """The others finish their save and wait for the stopped rank in their next step (no
    progress, fresh heartbeats): they are not fenced for it; the silent one is, after its
    save section's timeout."""
    d, coord, cmds, clock, logs = _job()
    r = Ranks(d, coord, clock)
    r.run(0.5)
    for lid in range(4):
        r.hold(lid, "save", 2)
    r.run(0.3)
    r.stopped.add(3)
    for lid in (0, 1, 2):  # their save ends; their step blocks on rank 3
        r.hold(lid, "step", 3)
    r.run(SAVE_S - 1)
    assert _fenced(cmds) == []
    r.run(2.0)
    assert _fenced(cmds) == [3] and d.plans[-1].failed_ranks == (3,)


def test_a_stale_heartbeat_in_the_step_section_is_still_fenced_at_the_heartbeat_timeout():
    d, coord, cmds, clock = _job()[:4]
    r = Ranks(d, coord, clock)
    r.run(0.5)
    r.stopped.add(1)
    r.run(HB_S + 0.5)
    assert _fenced(cmds) == [1]


def test_a_standby_spare_is_judged_by_the_heartbeat_timeout():
    """A spare has no rank: no section extends its heartbeat's deadline."""
    d, coord, cmds, clock = _job()[:4]
    r = Ranks(d, coord, clock)
    r.hold(4, "startup", 0)
    r.run(0.5)
    r.stopped.add(4)
    r.run(HB_S + 0.5)
    assert _fenced(cmds) == [4]


def test_a_section_change_is_progress():
    """A rank that enters and leaves its eval between two polls (a new entry count, no new
    iteration) has made progress."""
    d, coord, cmds, clock = _job()[:4]
    r = Ranks(d, coord, clock)
    for n in range(2, 8):
        r.hold(0, "step", n)
        r.run(STEP_S * 0.6)
    assert _fenced(cmds) == []


def test_tracker_first_step_is_startup_then_sections_nest():
    t = SectionTracker()
    assert t.status() == {"section": "startup", "section_n": 0}
    t.enter("step")
    assert t.status()["section"] == "startup"  # the first step: pinned slots, warmup
    t.leave()
    t.step_done()
    assert t.status() == {"section": "step", "section_n": 3}
    t.enter("eval")
    t.enter("data")
    assert t.status() == {"section": "data", "section_n": 5}
    t.leave()
    assert t.status() == {"section": "eval", "section_n": 6}
    with pytest.raises(ConfigError, match="unknown section 'checkpoint'"):
        t.enter("checkpoint")


def test_section_timeout_flags():
    assert parse_section_timeouts("save=3600, eval=90") == {"save": 3600.0, "eval": 90.0}
    with pytest.raises(ConfigError, match="--deadpool-progress-timeout"):
        parse_section_timeouts("step=10")
    with pytest.raises(ConfigError, match="SECONDS must be a number"):
        parse_section_timeouts("save=soon")
    cfg = DeadpoolConfig(progress_timeout_s=40.0, section_timeouts_s={"save": 3600.0})
    dec = cfg.decider()
    assert dec.section_timeout_s("step") == 40.0 and dec.section_timeout_s("save") == 3600.0
    assert dec.section_timeout_s("data") == 1800.0  # the default
    with pytest.raises(ConfigError, match="larger than --deadpool-heartbeat-timeout"):
        DeadpoolConfig(section_timeouts_s={"eval": 1.0})


def test_megatron_lm_save_eval_and_data_run_in_their_sections():
    """lm.join wraps these names in megatron.training.training (train() and pretrain() look
    them up there), so the patch series is unchanged."""
    seen = []

    class Sec:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            seen.append(("enter", self.name))

        def __exit__(self, *exc):
            seen.append(("leave", self.name))

    class Training:
        save_checkpoint = staticmethod(lambda it: seen.append(("save_checkpoint", it)))
        evaluate_and_print_results = staticmethod(lambda: seen.append(("eval",)))
        build_train_valid_test_data_iterators = staticmethod(lambda p: (1, 2, 3))

    mark_sections(Training, Sec)
    mark_sections(Training, Sec)  # idempotent
    Training.save_checkpoint(7)
    assert Training.build_train_valid_test_data_iterators(None) == (1, 2, 3)
    Training.evaluate_and_print_results()
    assert seen == [("enter", "save"), ("save_checkpoint", 7), ("leave", "save"),
                    ("enter", "data"), ("leave", "data"), ("enter", "eval"), ("eval",),
                    ("leave", "eval")]


def test_native_code_holding_the_gil_stops_a_python_heartbeat_thread():
    """Why a stale heartbeat inside save/eval/data/startup is not taken as death: the
    heartbeat thread is Python, and native code that holds the GIL (here libc's usleep
    called through PyDLL, which keeps the GIL, as a C++ extension without a GIL release
    does) stops it for the whole call. No tick can land inside the hold."""
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    th = threading.Thread(target=ticker, daemon=True)
    th.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    ctypes.PyDLL(None).usleep(600_000)  # 0.6 s in C with the GIL held
    t1 = time.monotonic()
    time.sleep(0.1)
    stop.set()
    th.join()
    assert any(t < t0 for t in ticks) and any(t > t1 for t in ticks)  # it ran around it
    # never during it: between t0 and t1 lies a tick-free stretch as long as the hold. (Not
    # "no tick in (t0, t1)": on a loaded machine the main thread may yield the GIL right
    # before the call or right after it, and the ticker then ticks inside [t0, t1].)
    inside = [t0] + sorted(t for t in ticks if t0 <= t <= t1) + [t1]
    assert max(b - a for a, b in zip(inside, inside[1:])) >= 0.55, inside


# ------------------------------------------------------------------ real jobs (slow)
def _flags(extra, iters=8):
    return ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--micro-batch-size", "1", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--global-batch-size", "4",
            "--mock-data", "--use-distributed-optimizer", "--vocab-size", "64",
            "--device", "cpu", "--train-iters", str(iters), "--deadpool",
            "--deadpool-heartbeat-timeout", "2", "--deadpool-progress-timeout", "4",
            "--deadpool-rendezvous-timeout", "200", *extra]


@pytest.mark.slow
def test_job_with_a_save_4x_the_step_timeout_is_not_fenced(tmp_path):
    p, s = launch(tmp_path, _flags(["--mock-save-interval", "4", "--mock-save-s", "16"]),
                  nodes=2, ppn=1, spares=1)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert s["recoveries"] == [] and "fencing" not in out, out[-4000:]


@pytest.mark.slow
def test_job_rank_stopped_in_its_save_is_fenced_after_the_save_timeout(tmp_path):
    p, s = launch(tmp_path, _flags(["--mock-save-interval", "4", "--mock-save-s", "1",
                                    "--deadpool-section-timeouts", "save=8"]),
                  nodes=2, ppn=1, spares=1, inject=["stop:rank=1@iter=4,phase=save"])
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    fence = [ln for ln in out.splitlines() if "fencing process" in ln]
    assert len(fence) == 1 and "in section save (timeout 8s)" in fence[0], fence or out[-4000:]
    assert [r["failed_ranks"] for r in s["recoveries"] if not r.get("superseded")] == [[1]]
