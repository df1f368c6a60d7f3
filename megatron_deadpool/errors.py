"""Typed errors. Each carries a message meant for the operator, not a traceback wall."""


class DeadpoolError(Exception):
    """Base class of every error raised on purpose by megatron-deadpool."""


class ConfigError(DeadpoolError, ValueError):
    """Invalid flags or configuration, detected before anything starts."""


class UnsupportedConfigError(ConfigError):
    """A Megatron feature whose process groups cannot be rebound at runtime."""


class MirrorCorruptError(DeadpoolError):
    """A mirror copy failed its checksum or carries the wrong iteration/owner."""


class NoCommittedStateError(DeadpoolError):
    """No iteration is committed on every needed holder: nothing safe to restore."""


class NoSpareError(DeadpoolError):
    """A failure happened and no spare is left to take the dead ranks."""


class TokenError(DeadpoolError):
    """A process presented the wrong job token to the coordinator."""


class StaleGenerationError(DeadpoolError):
    """A process tried to act in a generation it is not a member of."""


class RebindAuditError(DeadpoolError):
    """A reference to a process group of an old generation is still reachable."""
