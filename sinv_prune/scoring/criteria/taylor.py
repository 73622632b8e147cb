"""Gate-gradient importance (Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sinv_prune.scoring.criteria.base import Criterion, Scores, batch_to, frozen_parameters, model_device, to_scores
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.surgery.block_inputs import preserve_modes
from sinv_prune.units import get_unit

LossFn = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]


@register_criterion("taylor")
class TaylorCriterion(Criterion):
    """Importance ``I_h = sum over batches of |dL/d xi_h|``, ``xi_h`` a gate on head ``h``.

    As in the authors' code (``compute_heads_importance``): each batch's gate gradient
    (a sum over its tokens) is taken in absolute value and accumulated over batches,
    then each layer is divided by the L2 norm of its heads' importances
    (``normalize=True``). Gates come from :func:`sinv_prune.units.heads.gates.head_gates`
    (``unit="mlp"``: :func:`~sinv_prune.units.mlp.gates.channel_gates`, one gate per MLP channel at
    the down projection's input; ``unit="experts"``: :func:`~sinv_prune.units.experts.gates.expert_gates`, one
    gate per routed expert on its routing probability); gradients are taken with ``torch.autograd.grad`` on the
    gates only, and every parameter has ``requires_grad`` off during the pass (flags restored
    after), so no ``.grad`` lands on the model's parameters and autograd keeps no graph for
    weight gradients. The model runs in eval mode (``train_mode=True`` keeps dropout on);
    every module's mode is restored after.

    The loss is ``model(**batch).loss``. A batch without ``labels`` gets
    ``labels=input_ids`` (padding set to -100) when the model has an LM head (causal LMs shift them inside; a
    masked LM then scores plain reconstruction, so pass masked ``labels`` for MLM); other
    heads need ``labels`` in the batch, or pass ``loss_fn(model, batch) -> loss``.

    **Memory**: the loss's gradient runs back through the whole model, so there is no
    one-block-at-a-time pass (``compute(..., layer_by_layer=True)`` is refused): the whole model
    sits on its device, and per batch autograd keeps every layer's activations that the backward
    needs (hidden states, MLP intermediates, attention weights in eager attention), which grows
    with depth and with batch x sequence length. Use small batches on large models.

    .. code-block:: yaml

        criterion: taylor
        options: {normalize: true}
    """

    needs_data = True
    units = ("heads", "mlp", "experts")

    def __init__(self, normalize: bool = True, train_mode: bool = False, loss_fn: LossFn | None = None):
        self.normalize = bool(normalize)
        self.train_mode = bool(train_mode)
        self.loss_fn = loss_fn
        self._importance: list[torch.Tensor] | None = None
        self.batches = 0

    def reset(self) -> None:
        self._importance, self.batches = None, 0

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        batch = batch_to(batch, model_device(model))
        with (
            preserve_modes(model, train=self.train_mode),
            frozen_parameters(model),
            torch.enable_grad(),
            get_unit(self.unit).gates(model) as gates,
        ):
            loss = self._loss(model, batch)
            live = [g for g in gates if g.numel()]
            grads = iter(torch.autograd.grad(loss, live, allow_unused=True)) if live else iter(())
            per_layer = []
            for gate in gates:
                grad = next(grads) if gate.numel() else None
                per_layer.append(torch.zeros_like(gate) if grad is None else grad.detach().abs())
        if self._importance is None:
            self._importance = per_layer
        else:
            if [t.numel() for t in per_layer] != [t.numel() for t in self._importance]:
                noun = get_unit(self.unit).noun
                raise ValueError(f"taylor: {noun} counts changed between batches; call reset() after pruning")
            self._importance = [a + b for a, b in zip(self._importance, per_layer, strict=True)]
        self.batches += 1

    def scores(self, model: nn.Module) -> Scores:
        if self._importance is None:
            raise ValueError("taylor: no batch seen; call update(model, batch) first")
        values = self._importance
        if self.normalize:
            values = [v / (v.pow(2).sum().sqrt() + 1e-20) for v in values]
        return to_scores(values)

    def report(self) -> dict:
        return {"batches": self.batches, "normalize": self.normalize}

    def _loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(model, batch)
        if "labels" not in batch:
            if "input_ids" not in batch or model.get_output_embeddings() is None:
                raise ValueError(
                    "taylor: the batch has no labels and the model has no LM head; "
                    "add labels to the batches or pass loss_fn"
                )
            labels = batch["input_ids"]
            if isinstance(batch.get("attention_mask"), torch.Tensor):
                labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
            batch = {**batch, "labels": labels}
        out = model(**batch)
        loss = out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise ValueError("taylor: the model returned no loss for this batch; pass loss_fn")
        return loss
