"""``transformers.Trainer`` for optimizers whose ``step`` needs the loss value (ECD).

The Trainer calls ``optimizer.step()`` with no closure, after it has run forward and
backward in :meth:`~transformers.Trainer.training_step` (and clipped the gradients). A
closure that recomputed the loss would run a second forward and backward, and the
Trainer's gradient accumulation and clipping would not apply to it. So
:class:`ClosureTrainer` keeps the Trainer's own forward/backward and hands the optimizer
the loss it already computed:

* ``training_step`` adds each micro-batch's detached loss (already divided for gradient
  accumulation, as the Trainer returns it) to a running sum: the loss of exactly the
  gradient that the step will use;
* the optimizer the Trainer steps gets ``step(closure=None)`` replaced, on that instance, by
  one that passes a closure returning this sum (averaged over processes in distributed
  runs, so every rank sees the same ``F``) and then resets it.

The closure does not re-evaluate the model: optimizers that call it more than once per
step for fresh values (``LBFGS``) are not served by this. Optimizers that ignore the
closure's value (AdamW, SGD, SOAP) work unchanged. With fp16 mixed precision the
``GradScaler`` refuses closures; use bf16 or float32 with ECD.
"""

from __future__ import annotations

import functools

import torch
from transformers import Trainer


class ClosureTrainer(Trainer):
    """A ``Trainer`` whose optimizer step receives a closure returning the step's training loss.

    >>> trainer = ClosureTrainer(model=model, args=args, train_dataset=ds,
    ...                          optimizers=(ECD(model.parameters()), None))
    """

    _sinv_step_loss: torch.Tensor | None = None
    _sinv_patched: object = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._install_closure()
        loss = super().training_step(model, inputs, num_items_in_batch)
        step_loss = self._sinv_step_loss
        self._sinv_step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        return loss

    def _step_loss(self) -> torch.Tensor:
        if self._sinv_step_loss is None:
            raise RuntimeError("optimizer step before any training_step: no loss to give it")
        loss = self._sinv_step_loss
        if self.accelerator.num_processes > 1:
            loss = self.accelerator.reduce(loss, reduction="mean")
        return loss

    def _install_closure(self) -> None:
        optimizer = self.optimizer
        if optimizer is None or self._sinv_patched is optimizer:
            return
        step = optimizer.step  # bound method (or an earlier instance-level wrapper)

        @functools.wraps(step)  # keeps the LR scheduler's marker on the step it wrapped
        def step_with_loss(closure=None):
            try:
                return step(closure if closure is not None else self._step_loss)
            finally:
                self._sinv_step_loss = None

        optimizer.step = step_with_loss
        self._sinv_patched = optimizer
