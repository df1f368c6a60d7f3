"""The ``--deadpool*`` flags that the reference trainer, the Megatron-LM patch (through
``extra_args_provider``) and ``deadpool launch`` share, so all accept exactly the same flags:
base/config.py's group, with ``--deadpool-mirror-transport`` from the mirror transport
registry (mirror/transport.py: its names are the choices, its entries' lines the help), so a
new transport is offered by its registry entry alone. Loads no torch."""

from __future__ import annotations

import argparse

from .base.config import add_config_args
from .mirror.transport import add_transport_arg


def add_deadpool_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--deadpool*`` group to ``parser`` (and return it)."""
    return add_config_args(parser, add_transport_arg)
