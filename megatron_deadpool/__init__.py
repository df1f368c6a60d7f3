"""megatron-deadpool: hot-swap fault tolerance for Megatron-LM training.

Importing this package has no side effects: it does not touch torch.cuda, start
threads or read the environment. Everything is switched on explicitly.
"""

__version__ = "0.1.0"
