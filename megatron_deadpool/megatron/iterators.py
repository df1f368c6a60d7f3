"""Megatron-LM's data iterators across a recovery.

After a rollback the loaders are rebuilt at the restored consumed samples (``lm.recover``),
and ``train()`` gets the new iterators. But ``pretrain()`` keeps the ones it built and, after
``train()`` returns, its final evaluation reads its valid iterator: one that the recovery
left where it stood when the failure struck (a survivor), so that evaluation read other
batches than a failure-free run's. :class:`PretrainIterators` remembers what ``pretrain()``
built and moves each rebuilt iterator's state into it, so every holder reads the rebuilt
stream.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple


class PretrainIterators:
    def __init__(self) -> None:
        self._built: Optional[Tuple[Any, Any]] = None  # (train, valid) as pretrain() built them

    def wrap(self, training_module) -> None:
        """Record the first (train, valid) iterators ``build_train_valid_test_data_iterators``
        returns in ``training_module`` (pretrain()'s); idempotent."""
        orig = training_module.build_train_valid_test_data_iterators
        if getattr(orig, "_deadpool_iterators", None) is self:
            return

        @functools.wraps(orig)
        def build_train_valid_test_data_iterators(*a, **k):
            out = orig(*a, **k)
            if self._built is None:
                self._built = (out[0], out[1])
            return out

        build_train_valid_test_data_iterators._deadpool_iterators = self
        training_module.build_train_valid_test_data_iterators = \
            build_train_valid_test_data_iterators

    def adopt(self, train, valid) -> Tuple[Any, Any]:
        """The rebuilt (train, valid), each moved into the iterator pretrain() holds where
        there is one of the same type (Megatron's ``RerunDataIterator``)."""
        old_train, old_valid = self._built or (None, None)
        return _in_place(old_train, train), _in_place(old_valid, valid)


def _in_place(old, new):
    if old is None or new is None or type(old) is not type(new) or not hasattr(old, "__dict__"):
        return new
    old.__dict__.clear()
    old.__dict__.update(new.__dict__)
    return old
