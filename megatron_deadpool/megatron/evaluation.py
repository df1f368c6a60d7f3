"""Megatron-LM's in-loop evaluation across a hot swap.

``train()`` evaluates at the end of a loop body (``iteration % eval_interval == 0``), after
``lm.after_step`` began that iteration's snapshot. A restore to iteration r therefore lands
*before* the evaluation at r: without a redo, the job would go on with the validation
samples of that evaluation unread (``consumed_valid_samples`` one evaluation behind), and
every later evaluation would read other batches than a failure-free run's. The same holds
when the failure strikes during the evaluation itself.

:class:`Evaluations` redoes it: after a restore to r (a survivor's ``recover``, a promoted
spare's ``attach``) it is armed when r's evaluation was due, and every rank runs it at its
next ``before_step`` (or, after a restore to the last iteration, when ``train()`` returns),
so the collectives match on survivors and spares alike. A restore of the initial commit
(``meta["initial"]``) has no evaluation to redo.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional

from . import ddp

# train()'s parameters that evaluate_and_print_results needs
EVAL_INPUTS = ("forward_step_func", "model", "process_non_loss_data_func", "config",
               "non_loss_data_func")


def due(args, iteration: int, meta: Optional[dict]) -> bool:
    """Whether the loop body of ``iteration`` evaluates (the condition ``train()`` uses),
    for a restore of ``meta``. Pure."""
    if meta is None or meta.get("initial"):
        return False
    interval = getattr(args, "eval_interval", None)
    return bool(interval and iteration % interval == 0 and getattr(args, "do_valid", False))


class Evaluations:
    def __init__(self) -> None:
        self._inputs: Optional[Dict[str, Any]] = None  # from train()'s arguments
        self._due: Optional[int] = None
        self.redone: list = []  # iterations whose evaluation was redone

    def wrap(self, training_module, after: Callable[[], None]) -> None:
        """Record the arguments ``pretrain()`` gives ``train()`` (a promoted spare never ran
        an evaluation, so they are taken there, not from an earlier one), and call
        ``after()`` when it returns: a restore to the last iteration ends the loop before
        any ``before_step``, and what that would have done happens there. Idempotent."""
        orig = training_module.train
        if getattr(orig, "_deadpool_evaluations", None) is self:
            return
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def train(*a, **k):
            bound = sig.bind_partial(*a, **k).arguments
            self._inputs = {name: bound.get(name) for name in EVAL_INPUTS}
            out = orig(*a, **k)
            after()
            return out

        train._deadpool_evaluations = self
        training_module.train = train

    def arm(self, args, iteration: int, meta: Optional[dict]) -> None:
        """After a restore to ``iteration`` with metadata ``meta``."""
        self._due = iteration if due(args, iteration, meta) else None

    def run_if_due(self, training_module, iteration: int, valid_iterator) -> bool:
        """At the top of the loop body: run the armed evaluation, as ``train()`` does (the
        forward pre-hooks off while it runs; the restore already synced the parameters)."""
        if self._due is None or self._due != iteration or self._inputs is None:
            self._due = None
            return False
        self._due = None
        x = self._inputs
        hooks = ddp.forward_pre_hooks_on(x["model"])
        ddp.set_forward_pre_hooks(x["model"], False)
        try:
            training_module.evaluate_and_print_results(
                f"iteration {iteration}", x["forward_step_func"], valid_iterator, x["model"],
                iteration, x["process_non_loss_data_func"], x["config"], verbose=False,
                write_to_tensorboard=True, non_loss_data_func=x["non_loss_data_func"])
        finally:
            ddp.set_forward_pre_hooks(x["model"], hooks)
        self.redone.append(iteration)
        return True
