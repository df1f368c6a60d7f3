"""Last-resort persistence: when memory cannot carry the job on, the survivors write the
copies they hold (``--deadpool-fallback-save``) and the job stops naming the saved iteration;
``--deadpool-resume`` then finishes bitwise-equal to a run that never failed."""

import argparse
import json
import os
import re
import threading
from types import SimpleNamespace

import pytest
import torch

from conftest import launch, layout_flags
from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.flags import add_deadpool_args
from megatron_deadpool.base.errors import ConfigError, MirrorCorruptError
from megatron_deadpool.mirror import persist, snapshot
from megatron_deadpool.mirror.held import HeldCopies, OwnSlots

FLAGS = layout_flags(2, 2, 12)
RUN = "0123456789abcdef"


def _manifest(world, job=7, run=RUN, tp=1, pp=1):
    return persist.Manifest(job, run, world, tp, pp, world // (tp * pp))


# ------------------------------------------------------------------ pure file logic
class _FakeMirror:
    """What persist.py reads of a mirror: its slots, what they hold, its job id."""

    def __init__(self, rank, job=7):
        t = torch.arange(40, dtype=torch.float32) + rank
        self.layout = snapshot.Layout([("w", t)], 256)
        self.rank, self.job, self.t = rank, job, t
        self.own = OwnSlots(rank)
        self.own.allocate(self.layout.total_bytes, False)
        self.held = HeldCopies(job)

    @property
    def holdings(self):  # what persist.py reads the layout through
        return SimpleNamespace(ensure_layout=lambda: self.layout)

    def seal(self, iteration):
        self.own.rewrite(iteration)
        slot = self.own.slot(iteration)
        snapshot.copy_tensors_in(slot, self.layout, [self.t * iteration])
        snapshot.seal(slot, self.layout, self.rank, iteration, {"iteration": iteration}, self.job)
        self.own.hold(iteration)


def test_an_iteration_is_complete_only_with_every_rank(tmp_path):
    mirrors = [_FakeMirror(r) for r in range(3)]
    for m in mirrors:
        m.seal(4)
    for m in mirrors[:2]:
        m.seal(5)
        persist.save_held(m, str(tmp_path), _manifest(3))
    persist.save_held(mirrors[2], str(tmp_path), _manifest(3))
    saved = persist.scan(str(tmp_path))
    assert saved.complete(3) == [(4, RUN)]
    assert persist.resume_candidates(saved, (3, 1, 1, 3))[0][0] == 4
    with pytest.raises(ConfigError, match="no iteration saved for all 4 ranks"):
        persist.resume_candidates(saved, (4, 1, 1, 4))


def test_buddy_copies_complete_a_dead_ranks_files(tmp_path):
    owner, holder = _FakeMirror(0), _FakeMirror(1)
    owner.seal(6)
    holder.seal(6)
    holder.held.slots = {0: [b.clone() for b in owner.own.buffers()]}
    holder.held.iters = {0: [6, -1]}
    saved = persist.save_held(holder, str(tmp_path), _manifest(2))  # the owner died: no save
    assert sorted((r, it) for r, it, _ in saved) == [(0, 6), (1, 6)]
    assert persist.resume_candidates(persist.scan(str(tmp_path)), (2, 1, 1, 2))[0][0] == 6


def test_a_torn_slot_is_not_saved(tmp_path):
    m = _FakeMirror(0)
    m.seal(3)
    m.own.slot(3)[200] ^= 0xFF  # flip a tensor byte after sealing
    assert persist.save_held(m, str(tmp_path), _manifest(1)) == []


def test_resume_adopts_a_file_of_another_job_after_verifying_it(tmp_path):
    old = _FakeMirror(0, job=111)
    old.seal(8)
    persist.save_held(old, str(tmp_path), _manifest(1, job=111))
    new = _FakeMirror(0, job=222)
    data = persist.read_slot(persist.scan(str(tmp_path)).path((8, RUN), 0))
    persist.adopt(new, data, 8, job=111)
    meta = snapshot.verify(new.own.slot(8), 0, 8, new.layout, job=222)
    assert meta == {"iteration": 8}
    out = torch.empty_like(new.t)
    snapshot.copy_tensors_out(new.own.slot(8), new.layout, [out])
    assert torch.equal(out, old.t * 8)
    data[300] ^= 0x01
    with pytest.raises(MirrorCorruptError, match="checksum"):
        persist.adopt(_FakeMirror(0, job=333), data, 8, job=111)


def test_periodic_saves_keep_two(tmp_path):
    m = _FakeMirror(0)
    for it in range(1, 9):
        m.seal(it)
        persist.periodic(m, str(tmp_path), 2, _manifest(1), it)
    assert sorted(it for it, _ in persist.scan(str(tmp_path)).ranks) == [6, 8]


def test_each_saved_iteration_has_a_manifest_of_its_job_run_and_layout(tmp_path):
    m = _FakeMirror(1, job=99)
    m.seal(5)
    persist.save_held(m, str(tmp_path), _manifest(8, job=99, tp=2, pp=2))
    d = tmp_path / f"iter_00000005-{RUN}"
    assert sorted(os.listdir(d)) == ["manifest.json", "rank1-of-8.snap"]
    assert json.loads((d / "manifest.json").read_text()) == {
        "iteration": 5, "job": 99, "run": RUN, "world": 8, "tp": 2, "pp": 2, "dp": 2}


def test_the_directory_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    """A renamed file survives a crash only once its directory entry is on disk."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync_dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync_file"))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    m = _FakeMirror(0)
    m.seal(3)
    persist.save_held(m, str(tmp_path), _manifest(1))
    i = calls.index(("replace", "rank0-of-1.snap"))
    assert calls[i - 1] == "fsync_file" and calls[i + 1] == "fsync_dir", calls


def test_stale_files_of_another_run_are_never_mixed_in(tmp_path):
    """A reused directory: an earlier run left rank 1's file of iteration 6; this run
    (same job secret, same layout) saves rank 0's. Iteration 6 is complete for neither."""
    old, new = _FakeMirror(1), _FakeMirror(0)
    old.seal(6)
    new.seal(6)
    persist.save_held(old, str(tmp_path), _manifest(2, run="00000000000000aa"))
    persist.save_held(new, str(tmp_path), _manifest(2, run="00000000000000bb"))
    saved = persist.scan(str(tmp_path))
    assert saved.complete(2) == []
    with pytest.raises(ConfigError, match="no iteration saved for all 2 ranks"):
        persist.resume_candidates(saved, (2, 1, 1, 2))


def test_every_generation_draws_the_same_run_id():
    """A spare promoted in generation 1 reads the launch's store under one more prefix than
    a rank of generation 0 (torch's default_pg over the generation's): it once drew a run id
    of its own, so after a swap the no-spare stop's files split over two runs and no
    iteration was complete (issue 50, found under ft_launcher)."""
    from torch.distributed import HashStore, PrefixStore

    launch = HashStore()
    gen0 = PrefixStore("default_pg", PrefixStore("gen0", launch))
    gen1 = PrefixStore("default_pg", PrefixStore("gen1", PrefixStore("job", launch)))
    first = persist.run_id(gen0)
    assert persist.run_id(gen1) == first == persist.run_id(launch)
    assert len(first) == 16 and persist.run_id(HashStore()) != first


def test_a_complete_iteration_of_another_layout_is_not_resumed(tmp_path):
    for r in range(4):
        m = _FakeMirror(r)
        m.seal(6)
        persist.save_held(m, str(tmp_path), _manifest(4, tp=2))
    saved = persist.scan(str(tmp_path))
    assert persist.resume_candidates(saved, (4, 2, 1, 2)) == [(6, RUN)]
    with pytest.raises(ConfigError, match="layout TP1.PP1.DP4.*world 4, TP2.PP1.DP2"):
        persist.resume_candidates(saved, (4, 1, 1, 4))


def test_a_corrupt_newest_file_falls_back_to_the_older_complete_iteration(tmp_path, caplog):
    """Rank 1's file of iteration 6 is damaged on disk: both ranks resume iteration 5, rank
    0 too (its own file of 6 is fine), with a warning, instead of failing."""
    root = str(tmp_path)
    for r in range(2):
        m = _FakeMirror(r)
        for it in (5, 6):
            m.seal(it)
        persist.save_held(m, root, _manifest(2))
    saved = persist.scan(root)
    path = saved.path((6, RUN), 1)
    with open(path, "r+b") as f:
        f.seek(300)
        byte = f.read(1)
        f.seek(300)
        f.write(bytes([byte[0] ^ 0x01]))
    votes, barrier, chosen = {}, threading.Barrier(2, timeout=10), {}

    def all_ok(rank, ok):
        votes[rank] = ok
        barrier.wait()
        both = all(votes.values())
        barrier.wait()
        return both

    def resume(rank):
        m = _FakeMirror(rank, job=555)
        key = persist.resume_from(
            persist.resume_candidates(saved, (2, 1, 1, 2)),
            lambda k: _load(m, saved, k), lambda ok: all_ok(rank, ok))
        chosen[rank] = (key, key[0] in m.own.iterations())

    threads = [threading.Thread(target=resume, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert chosen == {0: ((5, RUN), True), 1: ((5, RUN), True)}
    assert any("falling back to an older complete iteration" in r.message
               for r in caplog.records)
    assert any("checksum" in r.message for r in caplog.records)


def _load(m, saved, key):
    try:
        persist.adopt(m, persist.read_slot(saved.path(key, m.rank)), key[0],
                      saved.manifests[key].job)
    except (MirrorCorruptError, ConfigError) as exc:
        return str(exc)
    return None


def test_flags_are_validated():
    p = add_deadpool_args(argparse.ArgumentParser())
    with pytest.raises(ConfigError, match="needs --deadpool-fallback-save"):
        DeadpoolConfig.from_args(p.parse_args(["--deadpool-fallback-every", "2"]))
    with pytest.raises(ConfigError, match=">= 0"):
        DeadpoolConfig(fallback_save_dir="d", fallback_every=-1)


# ------------------------------------------------------------------ end to end
def _stops_then_resumes(tmp_path, reference, save_flags, spares, inject):
    d, events = tmp_path / "fallback", tmp_path / "events.jsonl"
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-fallback-save", str(d),
                                     "--deadpool-events", str(events), *save_flags],
                  spares=spares, inject=inject)
    assert p.returncode != 0, p.stdout[-3000:]
    saved = s["fallback_save"]
    assert saved["iteration"] is not None and saved["bytes"] > 0, (saved, p.stdout[-3000:])
    assert f"fallback save: iteration {saved['iteration']} of every rank" in p.stdout
    writers = [e for e in map(json.loads, events.read_text().splitlines())
               if e["event"] == "fallback_save"]
    assert writers, "no survivor reported a fallback save"
    r, s2 = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-resume", str(d)],
                   spares=0, name="resumed")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    assert s2["final_state_sha256"] == reference(FLAGS)["final_state_sha256"]
    return saved, s, s2


@pytest.mark.slow
def test_lost_primary_and_buddy_saves_then_resumes_bitwise(tmp_path, reference):
    """Node 1's ranks (2, 3) keep their copies on node 2: both nodes die together, so memory
    holds no copy of ranks 2 and 3; the periodic saves (every 2 iterations) hold them."""
    saved, _, resumed = _stops_then_resumes(
        tmp_path, reference, ["--deadpool-fallback-every", "2"], spares=2,
        inject=["kill:node=1@iter=7", "kill:node=2@iter=7"])
    assert saved["iteration"] in (4, 6)
    assert resumed["completed_iters"] == 12 - saved["iteration"]


@pytest.mark.slow
def test_no_spare_left_saves_what_survivors_hold_then_resumes_bitwise(tmp_path, reference):
    """No periodic saves: with no spare left, the survivors' own and buddy copies cover
    every rank of the last committed iteration."""
    saved, stopped, resumed = _stops_then_resumes(
        tmp_path, reference, [], spares=1, inject=["kill:node=1@iter=4", "kill:node=3@iter=8"])
    assert stopped["error"].startswith("no spare left")
    # The stop message is written when the decider stops the job, from the heartbeats (every
    # 0.5 s; with the implicit commit a rank learns of k's commit when step k+1 returns): a
    # committed iteration, possibly older than the newest one every survivor then saves.
    named = int(re.search(r"last committed iteration (-?\d+)$", stopped["error"]).group(1))
    assert 0 <= named <= saved["iteration"] <= 8, (named, saved)
    assert resumed["completed_iters"] == 12 - saved["iteration"]


def test_megatron_lm_accepts_the_fallback_and_the_resume():
    """Megatron-LM's script takes both (test_megatron_lm_train.py runs them through a
    stop and a resume)."""
    from megatron_deadpool.adapters.lm_rules import unsupported_args

    args = argparse.Namespace(use_distributed_optimizer=True, deadpool_resume="d",
                              deadpool_fallback_save="d")
    assert not any("--deadpool" in r for r in unsupported_args(args))


@pytest.mark.parametrize("secret", ["the-job-secret", None])
@pytest.mark.parametrize("planted", ["x/../../..", "0123456789abcdef", "\udcff", b"\xff\xfe"])
def test_a_run_id_planted_before_the_job_is_refused_and_the_ranks_agree(secret, planted,
                                                                        caplog):
    """Issue 58: a store client without the secret writes the run-id key first (a path that
    climbs out of the fallback directory, a well-formed id it chose, a lone surrogate, bytes
    that are not UTF-8). With the job secret every such value is refused, named by its key,
    and every rank reads the same next key: one run id, drawn by the job. Without a secret
    only the form is checked (the well-formed id is taken: nothing signs it)."""
    from torch.distributed import HashStore, PrefixStore

    launch = HashStore()
    launch.set(persist.RUN_ID_KEY, planted.encode("utf-8", "surrogatepass")
               if isinstance(planted, str) else planted)
    got = {persist.run_id(PrefixStore(f"gen{g}", launch), secret) for g in range(3)}
    (run,) = got
    if secret is None and planted == "0123456789abcdef":
        assert run == planted
        return
    assert run != planted and len(run) == 16 and int(run, 16) >= 0
    assert f"store key '{persist.RUN_ID_KEY}'" in caplog.text and "refused" in caplog.text
    assert persist.iteration_dir("/fb", 3, run).startswith("/fb/iter_00000003-")


def test_a_run_id_not_of_its_form_never_becomes_a_path():
    for bad in ("x/../../..", "../" * 6, "0123456789abcdeF", ""):
        with pytest.raises(ConfigError, match="not 16 hex digits"):
            persist.iteration_dir("/fb", 3, bad)


def test_every_run_id_key_forged_stops_with_one_line():
    from torch.distributed import HashStore

    store = HashStore()
    for n in range(persist.RUN_ID_TRIES):
        store.set(persist.RUN_ID_KEY + (f"/{n}" if n else ""), "forged")
    with pytest.raises(ConfigError, match="without the job secret"):
        persist.run_id(store, "the-job-secret")
