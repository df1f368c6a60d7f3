"""The fault scenarios of the reliability matrix: a declarative schedule per scenario, what
must happen, and the layouts. Shared by tests/test_reliability.py and
scripts/fault_matrix.py (which regenerates docs/reliability.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

ITERS = 12

# name -> (tp, pp, micro batch); 8 ranks as 4 nodes x 2 in every layout.
LAYOUTS = {"TP2.PP2.DP2": (2, 2, 2), "TP1.PP4.DP2": (1, 4, 2), "TP1.PP1.DP8": (1, 1, 1),
           "TP4.PP1.DP2": (4, 1, 2)}

BITWISE, STOPPED, FAILED_FAST = "recovered, bitwise", "stopped cleanly", "failed fast"


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Tuple[str, ...]
    expect: str = BITWISE
    spares: int = 1
    flags: Tuple[str, ...] = ()
    ci: bool = False          # in the CI subset (on TP2.PP2.DP2)
    what: str = ""
    recoveries: Optional[int] = None  # exact count expected, when it is fixed
    iters: int = ITERS        # a longer job, where a wall-clock fault must land inside it
    local_restarts: Optional[int] = None  # recoveries that restarted a process in its slot
    unprotected: bool = False  # the summary must report rejected copies and UNPROTECTED ranks
    refused_peers: int = 0    # at least this many mirror connections refused (impostors)
    drains: Optional[int] = None  # planned swaps applied, each with nothing redone
    trajectory: Tuple[str, ...] = ()  # flags that change the training itself (--bf16): the
    # failure-free reference runs with them too

    def reference_key(self) -> Tuple[int, Tuple[str, ...]]:
        """What the scenario's failure-free reference run depends on."""
        return self.iters, self.trajectory


SCENARIOS = [
    Scenario("kill_forward_backward", ("kill:node=1@iter=6",), recoveries=1,
             what="SIGKILL a node in forward/backward"),
    Scenario("kill_optimizer_step", ("kill:rank=5@iter=6,phase=optimizer",), recoveries=1,
             what="SIGKILL a rank inside its optimizer step"),
    Scenario("kill_mirror_transfer", ("kill:rank=5@iter=6,phase=mirror",), recoveries=1,
             what="SIGKILL a rank inside its mirror job (snapshot sent, commit pending)"),
    Scenario("hang_sigstop", ("stop:rank=3@iter=6",), recoveries=1,
             flags=("--deadpool-heartbeat-timeout", "3"),
             what="SIGSTOP a rank: heartbeat timeout, fenced"),
    Scenario("sigterm", ("term:rank=3@iter=6",), recoveries=1, what="SIGTERM a rank"),
    # detected like a hang: the heartbeat timeout (2 s) plus the recovery
    Scenario("node_power_loss", ("poweroff:node=2@iter=6",), recoveries=1, ci=True,
             flags=("--deadpool-heartbeat-timeout", "2"),
             what="a node loses power: its agent and processes die together, no exit is "
                  "reported; the heartbeats find it, the whole node in one plan"),
    Scenario("bf16_kill", ("kill:node=1@iter=6",), recoveries=1, trajectory=("--bf16",),
             what="SIGKILL a node in a bf16 run (bf16 params, fp32 main params)"),
    Scenario("segfault", ("segv:rank=3@iter=6",), recoveries=1,
             what="SIGSEGV a rank"),
    Scenario("two_nodes_k2", ("kill:node=1@iter=6", "kill:node=2@iter=6"), spares=2,
             flags=("--deadpool-replicas", "2"),
             what="two nodes at once, 2 spare nodes, 2 buddy copies"),
    Scenario("primary_and_buddy_k1", ("kill:node=1@iter=6", "kill:node=2@iter=6"),
             spares=2, expect=STOPPED,
             what="a rank and its only buddy die together (K=1): unrecoverable from memory"),
    Scenario("cascade_in_rendezvous",
             ("kill:node=1@iter=6", "kill:rank=6@iter=6,phase=rendezvous"), spares=2,
             ci=False, what="a second kill while the first recovery's world forms"),
    Scenario("cascade_in_rebuild_groups",
             ("kill:node=1@iter=6", "kill:rank=6@iter=6,phase=rebuild_groups"), spares=2,
             what="a second kill while the first recovery rebuilds the model-parallel groups "
                  "(the others wait in group creation for a dead member; the abort ends "
                  "that wait)"),
    Scenario("cascade_in_restore",
             ("kill:node=1@iter=6", "kill:rank=6@iter=6,phase=restore_state"), spares=2,
             what="a second kill during the first recovery's restore"),
    Scenario("kill_iteration_1", ("kill:node=2@iter=1",), recoveries=1,
             what="SIGKILL a node in the first step (restores the initial commit)"),
    Scenario("kill_iteration_2", ("kill:node=2@iter=2",), recoveries=1,
             what="SIGKILL a node in the second step"),
    Scenario("kill_first_mirror_job", ("kill:rank=5@iter=1,phase=mirror",), recoveries=1,
             what="SIGKILL a rank inside the first mirror job after a step"),
    Scenario("kill_first_optimizer_step", ("kill:rank=5@iter=1,phase=optimizer",),
             recoveries=1, what="SIGKILL a rank inside the first optimizer step"),
    Scenario("kill_last_iteration", (f"kill:node=1@iter={ITERS}",), recoveries=1,
             what="SIGKILL a node in the last step"),
    # 40 iterations: the standby kill (1 s after the first iteration) must land well before
    # the node kill; at iteration 9 it once came 0.16 s after it and hit promoted spares.
    Scenario("spare_dies_in_standby", ("kill:node=4@t=1", "kill:node=1@iter=30"), spares=2,
             recoveries=1, iters=40,
             what="a standby spare node dies (unstaged), later a node kill"),
    Scenario("spare_exhaustion", ("kill:node=1@iter=4", "kill:node=2@iter=8"), spares=1,
             expect=STOPPED, what="a second node dies when no spare is left"),
    # 40 iterations: the fastest layout (TP1.PP1.DP8) ran 12 in less than the 0.9 s wait.
    Scenario("unstaged_kill", ("kill:node=2@t=0.9",), recoveries=1, iters=40,
             what="SIGKILL from outside at a wall-clock instant (seeded), not a fault point"),
    Scenario("local_restart", ("kill:rank=5@iter=6",), recoveries=1, local_restarts=1,
             flags=("--deadpool-max-local-restarts", "1"),
             what="SIGKILL one process on a healthy node: restarted in its slot, no spare spent"),
    Scenario("local_error", ("raise:rank=3@iter=5",), expect=FAILED_FAST, ci=True,
             what="an exception in one rank's step: the job fails fast, no recovery"),
    # The rendezvous timeout of 20 s makes the mirror's operation deadline 5 s and the
    # take-plan fence 10 s: the promoted spare's model build (12 s longer than usual)
    # outlasts both, as a GPU model build outlasts the default 15 s deadline.
    Scenario("slow_spare_build", ("kill:node=1@iter=6",), recoveries=1,
             flags=("--deadpool-rendezvous-timeout", "20", "--spare-build-delay", "12"),
             what="a promoted spare builds its model for longer than the survivors' operation "
                  "deadline: they wait for it to be ready"),
    Scenario("holder_drops_copies", ("drop:rank=3@iter=3",), recoveries=0, unprotected=True,
             what="a holder rejects every copy it receives from iteration 3 on: no failure, "
                  "the run finishes and reports its rejected copies and UNPROTECTED ranks"),
    # A synchronous save 4x the step section's timeout (8 s): its own section, not a hang.
    Scenario("long_save", (), recoveries=0,
             flags=("--deadpool-progress-timeout", "8", "--mock-save-interval", "8",
                    "--mock-save-s", "32"),
             what="a save (mock, every rank) lasting 4x the step timeout: nobody is fenced"),
    # Stopped inside its save: fenced after the save section's timeout (10 s), not at the
    # heartbeat timeout. The others wait for it in their next step: the rendezvous timeout
    # of 200 s keeps their gloo deadline (25 s) past that.
    Scenario("sigstop_in_save", ("stop:rank=3@iter=6,phase=save",), recoveries=1, ci=False,
             flags=("--mock-save-interval", "6", "--mock-save-s", "1",
                    "--deadpool-section-timeouts", "save=10",
                    "--deadpool-rendezvous-timeout", "200"),
             what="SIGSTOP a rank inside its save: fenced after the save section's timeout"),
    # Rank 2 knocks on all 8 listeners: an old bare hello and a wrong proof are refused at
    # once (16); its silent connections are refused at the handshake deadline, if the run
    # still goes on then.
    Scenario("impostor_mirror_peer", ("impostor:rank=2@iter=3",), recoveries=0, ci=True,
             refused_peers=16,
             what="a client without the job secret connects to every mirror listener (old "
                  "hello, wrong proof, silent): refused and logged, training goes on"),
]

# Planned swaps (docs/planned-swaps.md): a drain, a straggler, and the two races of item 4.
SCENARIOS += [
    Scenario("drain", ("drain:node=2@iter=6",), recoveries=0, drains=1,
             what="a drain of a live node: its ranks move to spares, nothing redone"),
    Scenario("straggler_drained", ("slow:node=2@iter=4,factor=3",), recoveries=0, drains=1,
             flags=("--deadpool-straggler-swap", "2:5"), iters=30,
             what="a node computes 3x slower: drained as a straggler, never fenced"),
    Scenario("drain_during_drain", ("drain:node=2@iter=5", "drain:node=1@iter=5"), spares=2,
             recoveries=0, drains=2, what="a second drain request while a drain is under way"),
    Scenario("kill_during_drain", ("drain:node=2@iter=6", "kill:node=1@iter=6"), spares=2,
             recoveries=1,
             what="a node dies as the node holding its copies is drained: the drain is undone, "
                  "the failure recovered, the drain asked again"),
]

BY_NAME = {s.name: s for s in SCENARIOS}


def trainer_flags(layout: str, extra=(), iters: int = ITERS) -> list:
    tp, pp, mbs = LAYOUTS[layout]
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--global-batch-size", "8", "--lr", "1e-3",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
            "--use-distributed-optimizer", "--vocab-size", "128", "--device", "cpu",
            "--train-iters", str(iters), "--deadpool", *extra]


def judge(s: Scenario, rc: int, summary: Optional[dict], reference_sha: str) -> str:
    """The cell of the matrix: the expected outcome's label, or 'FAILED: why'."""
    if summary is None:
        return "FAILED: no summary"
    if s.expect == BITWISE:
        if rc != 0:
            return f"FAILED: exit {rc}: {summary.get('error')}"
        from megatron_deadpool.base.faults import KINDS

        fired = sum(KINDS[x.partition(":")[0]].claimed for x in s.inject)  # reported ones
        if len(summary.get("faults", [])) != fired:
            return f"FAILED: {len(summary.get('faults', []))} of {fired} faults fired"
        if summary["final_state_sha256"] != reference_sha:
            return "FAILED: fingerprint differs from the failure-free run"
        live = [r for r in summary["recoveries"] if not r.get("superseded")]
        if s.recoveries is not None and len(live) != s.recoveries:
            return f"FAILED: {len(live)} recoveries, expected {s.recoveries}"
        if any(r["recomputed_iters"] is None or r["recomputed_iters"] > 1 for r in live):
            return "FAILED: more than one iteration redone"
        applied = [d for d in summary.get("drains", []) if d["applied"]]
        if s.drains is not None and (len(applied) != s.drains or any(
                d["iterations_redone"] != 0 for d in applied)):
            return f"FAILED: drains {summary.get('drains')}, expected {s.drains} with 0 redone"
        local = len(summary.get("local_restarts", []))
        if s.local_restarts is not None and local != s.local_restarts:
            return f"FAILED: {local} local restarts, expected {s.local_restarts}"
        m = summary.get("mirror", {})
        if s.unprotected and not (m.get("rejected_copies") and m.get("unprotected_ranks")):
            return f"FAILED: the dropped copies were not reported: {m}"
        if m.get("refused_peers", 0) < s.refused_peers:
            return (f"FAILED: {m.get('refused_peers', 0)} impostor connections refused, "
                    f"expected at least {s.refused_peers}")
        return BITWISE
    if rc == 0:
        return "FAILED: the job succeeded but should have stopped"
    err = summary.get("error") or ""
    if s.expect == STOPPED:
        import re

        m = re.search(r"last committed iteration (-?\d+)", err)
        return f"{STOPPED} at iteration {m.group(1)}" if m else f"FAILED: unclear stop: {err}"
    if "injected local error" in err and not summary.get("recoveries"):
        return FAILED_FAST
    return f"FAILED: {err or 'no error'}; recoveries {summary.get('recoveries')}"
