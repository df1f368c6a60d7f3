"""megatron-deadpool: hot-swap fault tolerance for Megatron-LM training.

Importing this package has no side effects: it does not touch torch.cuda, start
threads or read the environment. Everything is switched on explicitly. ``Deadpool`` is
loaded on first use (it pulls in torch).
"""

from .base.config import DeadpoolConfig
from .base.errors import (ConfigError, DeadpoolError, ForgedRecordError, JobStopped,
                          MirrorCorruptError, MirrorError, NoCommittedStateError, NoSpareError,
                          RebindAuditError, StaleGenerationError, StopReason, TokenError,
                          UnsupportedConfigError)
from .flags import add_deadpool_args

__version__ = "0.1.0"

__all__ = ["Deadpool", "DeadpoolConfig", "add_deadpool_args", "ConfigError", "DeadpoolError",
           "ForgedRecordError", "JobStopped", "MirrorCorruptError", "MirrorError", "NoCommittedStateError",
           "NoSpareError", "RebindAuditError", "StaleGenerationError", "StopReason",
           "TokenError", "UnsupportedConfigError"]


def __getattr__(name):
    if name == "Deadpool":
        from .api import Deadpool

        return Deadpool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
