"""Attention entropy per head: how spread out each head's attention is over the batches seen."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.criteria.base import Criterion, Scores, batch_to, model_device
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.surgery.block_inputs import preserve_modes


@register_criterion("entropy")
class EntropyCriterion(Criterion):
    """Score = minus the mean attention entropy of the head (nats): focused heads are kept.

    For every query position (padding excluded through ``attention_mask``) the entropy
    ``-sum_k p_k log p_k`` of the head's attention row is averaged over all batches.
    The weights are read from each attention module's output through forward hooks,
    which needs eager attention: a model on ``sdpa``/``flash`` is switched to ``eager``
    for the pass and switched back after. Runs in eval mode, without gradients.

    Sign: lower entropy means more focused attention. Voita et al. (2019, "Analyzing
    Multi-Head Self-Attention") found the heads that matter to be the confident ones
    (high maximum attention weight), while near-uniform heads act as averages that the
    rest of the model can stand in for, so high entropy is pruned first. Heads that
    attend to one "sink" token are focused yet often removable; ``invert=True`` prunes
    focused heads first instead.

    .. code-block:: yaml

        criterion: entropy
        options: {invert: false}
    """

    needs_data = True

    def __init__(self, invert: bool = False):
        self.invert = bool(invert)
        self.reset()

    def reset(self) -> None:
        self._sums: list[torch.Tensor] | None = None
        self._rows = 0
        self.batches = 0

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        adapter = get_adapter(model)
        batch = batch_to(batch, model_device(model))
        batch.pop("labels", None)
        weights: dict[int, torch.Tensor | None] = {}
        handles = [
            adapter.attention(layer).register_forward_hook(_capture(weights, layer))
            for layer in range(adapter.num_layers)
        ]
        try:
            with preserve_modes(model), torch.no_grad(), _eager(model):
                model(**batch)
        finally:
            for handle in handles:
                handle.remove()
        mask = batch.get("attention_mask")
        sums, rows = [], None
        for layer in range(adapter.num_layers):
            heads = adapter.layout(layer).num_heads
            w = weights.get(layer)
            if heads == 0:
                sums.append(torch.zeros(0, dtype=torch.float64))
                continue
            if w is None or w.shape[1] != heads:
                raise ValueError(f"entropy: layer {layer} returned no attention weights of its {heads} heads")
            layer_sum, rows = _entropy_sum(w, mask)
            sums.append(layer_sum)
        if self._sums is None:
            self._sums = sums
        elif [s.numel() for s in sums] != [s.numel() for s in self._sums]:
            raise ValueError("entropy: head counts changed between batches; call reset() after pruning")
        else:
            self._sums = [a + b for a, b in zip(self._sums, sums, strict=True)]
        self._rows += rows or 0
        self.batches += 1

    def scores(self, model: nn.Module) -> Scores:
        if self._sums is None:
            raise ValueError("entropy: no batch seen; call update(model, batch) first")
        sign = 1.0 if self.invert else -1.0
        return [[sign * float(x) / max(self._rows, 1) for x in s] for s in self._sums]

    def report(self) -> dict:
        return {"batches": self.batches, "query_rows": self._rows, "invert": self.invert}


def _capture(store: dict, layer: int):
    def hook(module, args, output):
        store[layer] = output[1] if isinstance(output, tuple) and len(output) > 1 else None

    return hook


def _entropy_sum(w: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Per head, the entropy summed over valid query rows of ``[B, H, Tq, Tk]`` weights; and the row count."""
    p = w.detach().double()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [B, H, Tq]
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == entropy.shape[-1]:
        valid = (mask != 0).to(entropy.device, torch.float64)  # [B, Tq]
        return (entropy * valid[:, None, :]).sum(dim=(0, 2)).cpu(), int(valid.sum())
    return entropy.sum(dim=(0, 2)).cpu(), entropy.shape[0] * entropy.shape[2]


@contextmanager
def _eager(model: nn.Module):
    """Run ``model`` with eager attention inside the block, restoring its implementation after."""
    before = getattr(model.config, "_attn_implementation", None)
    if before in (None, "eager"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)
