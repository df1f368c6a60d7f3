"""Typed errors. Each carries a message meant for the operator, not a traceback wall."""

import enum


class DeadpoolError(Exception):
    """Base class of every error raised on purpose by megatron-deadpool."""


class ConfigError(DeadpoolError, ValueError):
    """Invalid flags or configuration, detected before anything starts."""


class UnsupportedConfigError(ConfigError):
    """A Megatron feature whose process groups cannot be rebound at runtime."""


class MirrorError(DeadpoolError):
    """A mirror job (snapshot, transfer, commit) failed: a peer failure for recovery."""


class TransportTimeout(MirrorError):
    """A mirror transport call did not complete within its timeout (a peer is gone)."""


class MirrorCorruptError(DeadpoolError):
    """A mirror copy failed its checksum or carries the wrong iteration/owner."""


class NoCommittedStateError(DeadpoolError):
    """No iteration is committed on every needed holder: nothing safe to restore."""


class ForgedRecordError(DeadpoolError):
    """A store record the job needs failed its MAC, was signed for another slot, or is
    missing where every genuine writer has written it: someone without the job secret
    wrote to the store (docs/threat-model.md). Terminal, and never taken for a lost state."""


class NoSpareError(DeadpoolError):
    """A failure happened and no spare is left to take the dead ranks."""


class TokenError(DeadpoolError):
    """A process presented the wrong job token to the coordinator."""


class StaleGenerationError(DeadpoolError):
    """A process tried to act in a generation it is not a member of."""


class RebindAuditError(DeadpoolError):
    """A reference to a process group of an old generation is still reachable."""


class StopReason(str, enum.Enum):
    """Why the coordinator stopped the job (the prefix of its shutdown message)."""

    COMPLETE = "complete"
    NO_SPARE = "no spare left"
    STARTUP = "startup error"  # a rank failed before it attached (membership/startup.py)
    FATAL = "fatal"          # a local error on one rank
    INTERRUPTED = "interrupted"
    OTHER = "stopped"

    @classmethod
    def of(cls, message: str) -> "StopReason":
        for r in cls:
            if message.startswith(r.value) or (r is cls.FATAL and " stopped: " in message):
                return r
        return cls.OTHER


class JobStopped(DeadpoolError):
    """Terminal: the coordinator stopped the job while this process was in it."""

    def __init__(self, message: str):
        super().__init__(message)
        self.reason = StopReason.of(message)


class NoSpareStopped(JobStopped, NoSpareError):
    """The job stopped because a failure found no spare left."""


def stopped(message: str) -> JobStopped:
    """The terminal error for a shutdown ``message`` from the coordinator."""
    if StopReason.of(message) is StopReason.NO_SPARE:
        return NoSpareStopped(message)
    return JobStopped(message)
