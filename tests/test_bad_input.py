"""Bad input and misuse, one place for every case: each gets one clear, typed error (for the
CLI: exit 2 and exactly one error line, no traceback, no worker started) and nothing is
overwritten (an existing summary file and results dir, the coordinator's plan, the live
tensors).

  1. invalid layout or batch sizes             test_invalid_layout_or_batch_sizes_*
  2. fewer spare processes than a node needs   test_fewer_spares_than_one_node_needs
  3. contradictory timeouts                    test_contradictory_timeouts_*
  4. a wrong job token                         test_wrong_job_token_*
  5. a mirror from another job/iteration/layout test_mirror_of_another_*
  6. a corrupted mirror (bit flip, buddy copy) test_bit_flipped_buddy_copy_*
  7. an unsupported megatron-core version      test_unsupported_megatron_*

All fast: no training job starts (the CLI cases fail in validation, before any worker).
"""

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, deadpool, layout_flags
from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.base.errors import ConfigError, MirrorCorruptError, NoSpareError, TokenError
from megatron_deadpool.launch.options import LaunchOptions, free_port, validate
from megatron_deadpool.adapters import lm_rules, tags
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.assign import assign_spares
from megatron_deadpool.base.config import DeciderConfig
from megatron_deadpool.membership.decider import Decider, Proc
from megatron_deadpool.mirror import snapshot
from megatron_deadpool.mirror.exchange import Exchange
from megatron_deadpool.mirror.mirror import Mirror
from megatron_deadpool.trainer.args import check_layout

SENTINEL = '{"from": "an earlier run"}\n'


# ---------------------------------------------------------------------------- helpers
def _outputs(tmp_path):
    """An earlier run's summary and results dir, which a refused launch must not touch."""
    summary = tmp_path / "summary.json"
    summary.write_text(SENTINEL)
    results = tmp_path / "results"
    results.mkdir()
    (results / "losses.jsonl").write_text('{"iteration": 1, "loss": 4.5}\n')
    return summary, results, ["--summary-json", str(summary), "--results-dir", str(results)]


def _assert_refused(p, match, summary, results):
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "Traceback" not in out
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1, p.stderr
    assert err[0].startswith("deadpool: error: ") and re.search(match, err[0]), err[0]
    assert "[launch]" not in p.stdout and "[n0" not in p.stdout  # nothing started
    assert summary.read_text() == SENTINEL
    assert sorted(x.name for x in results.iterdir()) == ["losses.jsonl"]
    assert (results / "losses.jsonl").read_text() == '{"iteration": 1, "loss": 4.5}\n'


def _launch(tmp_path, launch_args, trainer_flags, env=None):
    summary, results, out_args = _outputs(tmp_path)
    if env is None:
        p = deadpool(["launch", *launch_args, *out_args, "--", *trainer_flags], cwd=tmp_path,
                     timeout=120)
    else:
        p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "launch",
                            *launch_args, *out_args, "--", *trainer_flags], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    return p, summary, results


def _flag(flags, name, value):
    i = flags.index(name)
    return flags[:i + 1] + [value] + flags[i + 2:]


# ---------------------------------------------------------------- 1. layout / batch sizes
@pytest.mark.parametrize("nodes,ppn,flags,match", [
    (3, 1, layout_flags(2, 2, 5),
     r"world size 3 is not divisible by tensor-parallel x pipeline-parallel = 2 x 2 = 4"),
    (4, 2, _flag(layout_flags(2, 2, 5), "--global-batch-size", "6"),
     r"--global-batch-size 6 is not divisible by --micro-batch-size x data-parallel = 2 x 2"),
    (2, 1, _flag(layout_flags(1, 1, 5), "--tensor-model-parallel-size", "0"),
     r"--tensor-model-parallel-size must be positive, got 0"),
])
def test_invalid_layout_or_batch_sizes_reference_trainer(tmp_path, nodes, ppn, flags, match):
    p, summary, results = _launch(tmp_path, ["--nodes", str(nodes), "--procs-per-node",
                                             str(ppn)], flags)
    _assert_refused(p, match, summary, results)


@pytest.mark.parametrize("flags,match", [
    (["--tensor-model-parallel-size", "3", "--pipeline-model-parallel-size", "1"],
     r"world size 8 is not divisible by tensor-parallel x pipeline-parallel = 3 x 1 = 3"),
    (["--tensor-model-parallel-size=2", "--pipeline-model-parallel-size", "2",
      "--micro-batch-size", "2", "--global-batch-size=6"],
     r"--global-batch-size 6 is not divisible by --micro-batch-size x data-parallel = 2 x 2"),
    (["--tensor-model-parallel-size", "2", "--context-parallel-size", "8"],
     r"world size 8 is not divisible by .* x context-parallel = 2 x 1 x 8 = 16"),
])
def test_invalid_layout_or_batch_sizes_script(tmp_path, flags, match):
    """With --script the launcher checks the layout too: Megatron-LM would otherwise fail
    later, once in every rank."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    p, summary, results = _launch(tmp_path, ["--nodes", "4", "--procs-per-node", "2",
                                             "--script", str(script)], flags)
    _assert_refused(p, match, summary, results)


def test_check_layout_is_pure_and_typed():
    assert check_layout(8, 2, 2, 2, 8) == 2
    assert check_layout(8, 2, 1, None, None) == 4  # batch sizes not given: not checked
    with pytest.raises(ConfigError, match="not divisible by tensor-parallel"):
        check_layout(6, 4, 1, 1, 8)
    with pytest.raises(ConfigError, match="--global-batch-size 12 is not divisible"):
        check_layout(8, 1, 1, 2, 12)


# ---------------------------------------------------------------- 2. too few spares
def test_fewer_spares_than_one_node_needs():
    """Node 1 (2 processes) dies and the spare pool holds 1 process: the decider stops the
    job with one clear reason and publishes no plan, so generation 0's plan stays current
    and the spare stays unassigned. (A launch is not refused up front: a job without enough
    spares still runs, and is stopped with its committed iteration when a node is lost.)"""
    with pytest.raises(NoSpareError, match=r"2 rank\(s\) failed \[2, 3\] but only 1 spare"):
        assign_spares([2, 3], [0, 0, 1, 1], [(8, 4)])

    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(8)}
    procs[8] = Proc(lid=8, node=4, role="spare")
    d = Decider(store=store, procs=procs, world_size=8, token="secret",
                send_command=lambda node, cmd: None,
                config=DeciderConfig(heartbeat_timeout_s=0.5, heartbeat_interval_s=0.1,
                                     grace_s=0.0), log=lambda m: None)
    d.publish_initial_plan()
    c = st.Coordinator(store, "secret")
    plan0 = store.get(st.k("plan", 0))
    for lid in range(9):
        c.push_event("join", lid=lid, nonce=f"n{lid}")
        c.beat(lid, seq=1, iteration=5, state="ACTIVE", committed=4)
    d.step()
    for lid in (2, 3):
        c.push_event("exit", lid=lid, code=-9, node=1)
    d.step()
    d.step()
    assert d.finished
    reason = c.shutdown_reason()
    assert reason.startswith("no spare left: 2 rank(s) failed [2, 3] but only 1 spare")
    assert "last committed iteration 4" in reason and d.failed_reason == reason
    assert c.current_gen() == 0 and store.get(st.k("plan", 0)) == plan0
    assert not store.check([st.k("plan", 1)])
    assert procs[8].rank is None


# ---------------------------------------------------------------- 3. contradictory timeouts
TIMEOUTS = [
    ({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5},
     ["--deadpool-heartbeat-interval", "1", "--deadpool-heartbeat-timeout", "1.5"],
     "at least twice --deadpool-heartbeat-interval"),
    ({"heartbeat_timeout_s": 10.0, "progress_timeout_s": 10.0},
     ["--deadpool-heartbeat-timeout", "10", "--deadpool-progress-timeout", "10"],
     "smaller than --deadpool-progress-timeout"),
    ({"heartbeat_timeout_s": 200.0, "progress_timeout_s": 300.0},
     ["--deadpool-heartbeat-timeout", "200"], "smaller than --deadpool-rendezvous-timeout"),
    ({"rendezvous_timeout_s": 700.0},
     ["--deadpool-rendezvous-timeout", "700"],
     "--deadpool-rendezvous-timeout must not exceed --deadpool-collective-timeout"),
    ({"collective_timeout_s": -1.0}, ["--deadpool-collective-timeout", "-1"],
     "--deadpool-collective-timeout must be > 0"),
]


@pytest.mark.parametrize("kw,flags,match", TIMEOUTS)
def test_contradictory_timeouts_config(kw, flags, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        DeadpoolConfig(enabled=True, **kw)


@pytest.mark.parametrize("kw,flags,match", TIMEOUTS)
def test_contradictory_timeouts_cli(tmp_path, kw, flags, match):
    p, summary, results = _launch(tmp_path, ["--nodes", "2", "--procs-per-node", "1"],
                                  layout_flags(1, 1, 5) + ["--deadpool", *flags])
    _assert_refused(p, re.escape(match), summary, results)


# ---------------------------------------------------------------- 4. wrong job token
def _job_store(store, secret="the-job-secret"):
    procs = {r: Proc(lid=r, node=r, role="active", rank=r) for r in range(2)}
    d = Decider(store=store, procs=procs, world_size=2, token=secret,
                send_command=lambda node, cmd: None, config=DeciderConfig(grace_s=0.0),
                log=lambda m: None)
    d.publish_initial_plan()
    return d


def test_wrong_job_token_worker_is_refused_at_admission():
    """A worker with the wrong DEADPOOL_TOKEN asks to join: TokenError, it is not admitted,
    and the coordinator's plan is untouched."""
    store = dist.HashStore()
    d = _job_store(store)
    plan0 = store.get(st.k("plan", 0))
    errors = []

    def join():
        try:
            st.Coordinator(store, "a-guessed-secret").request_admission(1, timeout_s=5)
        except TokenError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=join)
    t.start()
    for _ in range(250):
        d.step()
        if not t.is_alive():
            break
        time.sleep(0.02)
    t.join()
    assert errors == ["coordinator refused process 1: the job secret does not match "
                      "(wrong DEADPOOL_TOKEN)"]
    assert d.procs[1].state != "alive"
    assert store.get(st.k("plan", 0)) == plan0 and st.Coordinator(
        store, "the-job-secret").current_gen() == 0


def test_wrong_job_token_node_agent_refused_before_starting_workers(tmp_path):
    """`deadpool launch --node-rank 1` with another DEADPOOL_TOKEN than node 0's: one error
    line, exit 2, no worker started, nothing written."""
    port = free_port()
    store = st.connect("127.0.0.1", port, timeout_s=30, is_master=True)  # node 0's store
    _job_store(store)
    plan0 = store.get(st.k("plan", 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               DEADPOOL_TOKEN="a-guessed-secret")
    p, summary, results = _launch(
        tmp_path, ["--nodes", "2", "--procs-per-node", "1", "--node-rank", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port - 1)],
        layout_flags(1, 1, 5) + ["--deadpool"], env=env)
    _assert_refused(p, r"not signed with this node's job secret \(wrong DEADPOOL_TOKEN\)",
                    summary, results)
    assert "[n1" not in p.stdout
    assert store.get(st.k("plan", 0)) == plan0
    assert st.Coordinator(store, "the-job-secret").current_gen() == 0
    # the right token passes the same check
    st.Coordinator(store, "the-job-secret").check_secret(timeout_s=5)


# ---------------------------------------------------------------- 5./6. mirror copies
JOB = snapshot.job_id("the-job-secret")


def _named(seed=0, b_shape=(3, 4)):
    g = torch.Generator().manual_seed(seed)
    return [("opt0.p0.param", torch.randn(10, generator=g)),
            ("opt0.p1.param", torch.randn(*b_shape, generator=g)),
            ("opt0.p0.step", torch.tensor(5.0))]


def _sealed(named, owner=3, it=7, job=JOB):
    layout = snapshot.Layout(named, 1 << 14)
    slot = snapshot.alloc_slot(layout.total_bytes, pin=False)
    snapshot.copy_tensors_in(slot, layout, [t for _, t in named])
    snapshot.seal(slot, layout, owner, it, {"iteration": it}, job=job)
    return layout, slot


class _BuddyTransport:
    """Stands in for the gloo transport: the buddy sends ``copy`` (restore path)."""

    def __init__(self, copy):
        self.copy = copy

    def exchange(self, sends, recvs):
        for _, buf in recvs:
            buf.copy_(self.copy)


def _restore_from_buddy(copy, live, owner=3, it=7):
    """A spare that took rank ``owner`` receives the buddy's ``copy`` into its own slot and
    restores it (Exchange.transfer_for_restore + Mirror.verify_local and load_local, as recovery does)."""
    m = Mirror(owner, replicas=1, meta_capacity=1 << 14, sources=lambda: live)
    try:
        m.job = JOB
        m.holdings.ensure_layout()
        exchange = Exchange(m.holdings, _BuddyTransport(copy), [], [], 1)
        exchange.transfer_for_restore(it, serve=[], receive_from=5)
        meta = m.verify_local(it)
        m.load_local(it)
        return meta
    finally:
        m.close()


def _live():
    return [(name, torch.zeros_like(t)) for name, t in _named()]  # a fresh spare's state


@pytest.mark.parametrize("what,copy_of,match", [
    ("job", dict(job=snapshot.job_id("another-job")), "written by another job"),
    ("iteration", dict(it=6), "holds rank 3 iteration 6"),
    ("owner", dict(owner=4), "holds rank 4 iteration 7"),
    ("layout (shape)", dict(b_shape=(4, 3)), "layout mismatch"),
    ("layout (names)", dict(names=True), "layout mismatch"),
])
def test_mirror_of_another_job_iteration_or_layout_is_refused(what, copy_of, match):
    """The copy has the right size but another job, iteration, owner or layout: refused by
    name, and the live tensors keep their values."""
    named = _named(b_shape=copy_of.get("b_shape", (3, 4)))
    if copy_of.get("names"):
        named = [(n.replace("param", "master"), t) for n, t in named]
    _, slot = _sealed(named, owner=copy_of.get("owner", 3), it=copy_of.get("it", 7),
                      job=copy_of.get("job", JOB))
    live = _live()
    before = [t.clone() for _, t in live]
    with pytest.raises(MirrorCorruptError, match=match):
        _restore_from_buddy(slot, live)
    assert all(torch.equal(t, b) for (_, t), b in zip(live, before)), what


def test_mirror_job_identity_is_in_the_header():
    layout, slot = _sealed(_named())
    h = snapshot.read_header(slot)
    assert h["job"] == JOB and h["owner"] == 3 and h["iteration"] == 7
    assert h["layout_id"] == layout.layout_id
    assert JOB != snapshot.job_id("another-job")
    assert b"the-job-secret" not in slot.numpy().tobytes()  # an id, never the secret
    with pytest.raises(MirrorCorruptError, match="written by another job"):
        snapshot.verify(slot, 3, 7, layout)  # verify without the job's id refuses too


@pytest.mark.parametrize("where", ["tensor", "step", "meta", "header_crc"])
def test_bit_flipped_buddy_copy_is_detected_never_loaded(where):
    named = _named()
    layout, slot = _sealed(named)
    off = {"tensor": layout.entries[1].offset + 5, "step": layout.entries[2].offset,
           "meta": layout.tensor_end + 3, "header_crc": 5 * 8}[where]
    slot[off] ^= 0x01  # one bit
    live = _live()
    with pytest.raises(MirrorCorruptError, match="checksum mismatch.*refusing to load it"):
        _restore_from_buddy(slot, live)
    assert all(torch.count_nonzero(t) == 0 for _, t in live)  # nothing copied in


def test_intact_buddy_copy_restores():
    """The control for the refusals above: the same path loads an intact copy."""
    named = _named()
    _, slot = _sealed(named)
    live = _live()
    assert _restore_from_buddy(slot, live)["iteration"] == 7
    assert all(torch.equal(t, s) for (_, t), (_, s) in zip(live, named))


# ---------------------------------------------------------------- 7. megatron-core version
def test_unsupported_megatron_version_of_a_script_tree(tmp_path):
    """`deadpool launch --script` with --deadpool on a Megatron-LM tree of another version."""
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "training" / "training.py").write_text("# deadpool_lm.recover(\n")
    (root / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 15\nPATCH = 0\n")
    script = root / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    p, summary, results = _launch(tmp_path, ["--nodes", "2", "--procs-per-node", "1",
                                             "--script", str(script)],
                                  ["--use-distributed-optimizer", "--deadpool"])
    _assert_refused(p, r"matches no supported tag \(by sha256: core_v0\.16\.1: "
                       r"megatron/training/arguments\.py missing; .*supported: "
                       + re.escape(tags.supported()), summary, results)


def test_unsupported_installed_megatron_core(tmp_path):
    """The reference trainer with --deadpool on an installed megatron-core of another
    version (a dist-info ahead of site-packages stands in for it)."""
    fake = tmp_path / "site"
    info = fake / "megatron_core-0.15.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\n"
                                   "Version: 0.15.0\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{fake}{os.pathsep}{REPO}")
    p, summary, results = _launch(tmp_path, ["--nodes", "2", "--procs-per-node", "1"],
                                  layout_flags(1, 1, 5) + ["--deadpool"], env=env)
    _assert_refused(p, r"supports megatron-core 0\.16\.1; the installed one is 0\.15\.0",
                    summary, results)


def test_megatron_version_checks_are_typed(monkeypatch):
    lm_rules.check_installed_megatron_core()  # this environment: 0.16.1
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.17.0")
    opts = LaunchOptions(nodes=2, procs_per_node=1,
                         trainer_argv=layout_flags(1, 1, 5) + ["--deadpool"])
    with pytest.raises(ConfigError, match="the installed one is 0.17.0"):
        validate(opts)
    validate(LaunchOptions(nodes=2, procs_per_node=1, trainer_argv=layout_flags(1, 1, 5)))
