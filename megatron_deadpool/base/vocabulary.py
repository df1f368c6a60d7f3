"""The words every layer shares: one ``Phase`` enum (fault points and recovery phases) and
one ``Event`` enum (the ``--deadpool-events`` JSON lines: written by the runtime, the world,
the alarms and the decider, read by ``deadpool report``). Both are ``str`` enums: they travel
in JSON as their values."""

from __future__ import annotations

import enum


class ValueEnum(str, enum.Enum):
    """A ``str`` enum that prints as its value (in logs, f-strings and JSON alike)."""

    def __str__(self) -> str:
        return self.value


class Phase(ValueEnum):
    """Where in an iteration, or in a recovery, something happens.

    iteration:  forward_backward ─► optimizer ─► mirror   (then save / eval sections)
    recovery:   the members from ``detect`` on, in their order: ``RECOVERY_PHASES``
    (``detect`` is the decider's: the failure until the plan; ``first_step`` the runtime's;
    the ones between are the steps' of control/steps.py, in its sequences' order)
    """

    FORWARD_BACKWARD = "forward_backward"
    OPTIMIZER = "optimizer"
    MIRROR = "mirror"
    SAVE = "save"  # entering the save section after iteration N
    EVAL = "eval"  # entering the evaluation section after iteration N
    # the recovery's phases, in order, from here on: a new one goes before FIRST_STEP
    DETECT = "detect"
    ABORT = "abort"
    RENDEZVOUS = "rendezvous"
    REBUILD_GROUPS = "rebuild_groups"
    RESTORE_STATE = "restore_state"
    FIRST_STEP = "first_step"


# the phases a recovery is timed in, in order (summary ``phases_s``): the enum's last members
RECOVERY_PHASES = tuple(Phase)[list(Phase).index(Phase.DETECT):]
PHASE_ORDER = tuple(p.value for p in RECOVERY_PHASES)
# where a scheduled fault may strike (``--inject ...,phase=P``)
FAULT_PHASES = (Phase.FORWARD_BACKWARD, Phase.OPTIMIZER, Phase.MIRROR, Phase.RENDEZVOUS,
                Phase.REBUILD_GROUPS, Phase.RESTORE_STATE, Phase.SAVE, Phase.EVAL)
SECTION_PHASES = (Phase.SAVE, Phase.EVAL)  # fired on entering a section (api.section)


class Event(ValueEnum):
    """One line of the events file: ``{"ts", "event", ...fields}``."""

    STEP = "step"                        # rank, iteration: a completed iteration
    PHASE = "phase"                      # phase, duration_s, generation, rank
    ABORT = "abort"                      # generation, rank, reason: communicators aborted
    PROMOTED = "promoted"                # lid, rank, generation: a spare took a rank
    RESTORED = "restored"                # generation, rank, iteration
    RESUMED = "resumed"                  # rank, iteration, dir (--deadpool-resume)
    AUDIT = "audit"                      # generation, rank, ...: the rebind audit
    FALLBACK_SAVE = "fallback_save"      # rank, dir, copies
    COPY_REJECTED = "mirror_copy_rejected"  # rank, owner, iteration, why
    UNPROTECTED = "unprotected"          # rank, iteration, committed
    LOCAL_RESTART = "local_restart"      # rank, node, exit_code, lid, replaces, warm (decider)
    SPARE_WAIT = "spare_wait"            # generation, ... (decider)
    DRAIN = "drain"                      # generation, node, reason, ranks (decider)
    DRAIN_REFUSED = "drain_refused"      # node, reason, why: the job goes on untouched
    DRAIN_BOUNDARY = "drain_boundary"    # generation, rank, iteration: where it stops
