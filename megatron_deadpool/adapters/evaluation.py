"""Megatron-LM's in-loop evaluation across a hot swap.

``train()`` evaluates at the end of a loop body (``iteration % eval_interval == 0``), after
the session's ``after_step`` (megatron/lm.py) began that iteration's snapshot. A restore to
iteration r therefore lands *before* the evaluation at r: without a redo, the job would go
on with the validation samples of that evaluation unread (``consumed_valid_samples`` one
evaluation behind), and every later evaluation would read other batches than a failure-free
run's. The same holds when the failure strikes during the evaluation itself.

:class:`Evaluations` redoes it: after a restore to r (a survivor's ``recover``, a promoted
spare's ``attach``) it is armed when r's evaluation was due, and every rank runs it at its
next ``before_step`` (or, after a restore to the last iteration, when ``train()`` returns),
so the collectives match on survivors and spares alike. A restore of the initial commit
(``meta["initial"]``) has no evaluation to redo.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from . import ddp

def due(args, iteration: int, meta: Optional[dict]) -> bool:
    """Whether the loop body of ``iteration`` evaluates (the condition ``train()`` uses),
    for a restore of ``meta``. Pure."""
    if meta is None or meta.get("initial"):
        return False
    interval = getattr(args, "eval_interval", None)
    start = getattr(args, "start_eval_at_iter", None)  # core_v0.19.0
    return bool(interval and iteration % interval == 0 and getattr(args, "do_valid", False)
                and (start is None or iteration >= start))


class Evaluations:
    def __init__(self) -> None:
        self._due: Optional[int] = None

    def arm(self, args, iteration: int, meta: Optional[dict]) -> None:
        """After a restore to ``iteration`` with metadata ``meta``."""
        self._due = iteration if due(args, iteration, meta) else None

    def run_if_due(self, training_module, iteration: int, valid_iterator,
                   train_args: Optional[Dict[str, Any]], extra: Sequence[str] = ()) -> bool:
        """At the top of the loop body: run the armed evaluation as ``train()`` does, with
        ``train_args`` (what pretrain() gave train(); ``extra``: the tag's further keyword
        arguments, tags.py), the forward pre-hooks off while it runs (the restore already
        synced the parameters)."""
        if self._due is None or self._due != iteration or train_args is None:
            self._due = None
            return False
        self._due = None
        x = train_args
        kwargs = {name: x.get(name) for name in extra}
        hooks = ddp.forward_pre_hooks_on(x["model"])
        ddp.set_forward_pre_hooks(x["model"], False)
        try:
            training_module.evaluate_and_print_results(
                f"iteration {iteration}", x["forward_step_func"], valid_iterator, x["model"],
                iteration, x["process_non_loss_data_func"], x["config"], verbose=False,
                write_to_tensorboard=True, non_loss_data_func=x.get("non_loss_data_func"),
                **kwargs)
        finally:
            ddp.set_forward_pre_hooks(x["model"], hooks)
        return True
