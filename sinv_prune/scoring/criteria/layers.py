"""Whole-layer criteria: ShortGPT's block influence, and an S-invariant depth score."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.criteria.base import Criterion, batch_to, model_device, observe
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.scoring.criteria.walk import walk_layers


@register_criterion("block_influence")
class BlockInfluenceCriterion(Criterion):
    """Block influence (ShortGPT, Men et al. 2024): ``BI_l = 1 - mean_t cos(x_l(t), y_l(t))``.

    ``x_l`` and ``y_l`` are the hidden states entering and leaving block ``l`` (forward hooks
    on the blocks, so no final norm is mixed into the last block's output), ``t`` every
    token with ``attention_mask != 0`` of every calibration batch (eval mode, no gradients,
    float64 sums). A block that changes its input little has a low BI and goes first;
    one that is the identity scores 0. Higher = keep.

    .. code-block:: yaml

        criterion: block_influence
        unit: layers
    """

    needs_data = True
    units = ("layers",)

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._cos: torch.Tensor | None = None
        self.batches = 0
        self.tokens = 0

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        blocks = get_adapter(model).layers()
        batch = batch_to(batch, model_device(model))
        batch.pop("labels", None)
        mask = batch.get("attention_mask")
        sums: dict[int, torch.Tensor] = {}
        hooks = [
            block.register_forward_hook(_cosine(sums, i, mask), with_kwargs=True) for i, block in enumerate(blocks)
        ]
        observe(model, batch, hooks)
        self._add(sums, len(blocks))

    walks_layers = True

    def update_layers(self, model: nn.Module, batches: list[Mapping[str, Any]]) -> None:
        """:meth:`update` over every batch, one block at a time (:mod:`~sinv_prune.scoring.criteria.walk`)."""
        sums: list[dict[int, tuple]] = [{} for _ in batches]

        def on_output(layer: int, j: int, feed: dict, x: torch.Tensor, y: torch.Tensor) -> None:
            _cosine(sums[j], layer, feed.get("attention_mask"))(None, (x,), {}, y)

        walk_layers(model, batches, on_output=on_output, desc="block_influence")
        for per_batch in sums:
            self._add(per_batch, get_adapter(model).num_layers)

    def _add(self, sums: dict[int, tuple], count: int) -> None:
        """Add one batch's per-block cosine sums."""
        missing = [i for i in range(count) if i not in sums]
        if missing:
            raise ValueError(f"block_influence: blocks {missing} were not called in the forward pass")
        total = torch.stack([sums[i][0] for i in range(count)])
        if self._cos is not None and self._cos.numel() != total.numel():
            raise ValueError("block_influence: the layer count changed between batches; call reset() after pruning")
        self._cos = total if self._cos is None else self._cos + total
        self.tokens += int(sums[0][1])
        self.batches += 1

    def scores(self, model: nn.Module) -> list[float]:
        if self._cos is None:
            raise ValueError("block_influence: no batch seen; call update(model, batch) first")
        if not self.tokens:
            raise ValueError("block_influence: every token seen was padding (attention_mask == 0)")
        if self._cos.numel() != get_adapter(model).num_layers:
            raise ValueError("block_influence: the layer count changed since the batches were seen; call reset()")
        return [float(1.0 - c) for c in (self._cos / self.tokens).cpu()]

    def report(self) -> dict:
        return {"batches": self.batches, "tokens": self.tokens}


def _cosine(store: dict, index: int, mask):
    """A forward hook adding up, over valid tokens, the cosine of the block's input and output."""

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        y = output[0] if isinstance(output, tuple | list) else output
        cos = nn.functional.cosine_similarity(x.detach().double(), y.detach().double(), dim=-1)  # [B, T]
        if isinstance(mask, torch.Tensor):
            if tuple(mask.shape) != tuple(cos.shape):
                raise ValueError(
                    f"block_influence: attention_mask {tuple(mask.shape)} does not match tokens {tuple(cos.shape)}"
                )
            cos = cos[mask.to(cos.device) != 0]
        store[index] = (cos.sum(), cos.numel())

    return hook


@register_criterion("sinv_depth")
class SinvDepthCriterion(Criterion):
    """S-invariant layer score from the NN6 measures: ``r_l = C_FF_l / mean_h C_Q_l^h``; score ``-r_l``.

    ``C_FF`` (the MLP's linear path ``W_down W_up``) and ``C_Q`` (per head) are the paper's
    distances from the S-invariant attractor (:func:`~sinv_prune.scoring.measures.head_measures`): 0
    at the attractor (converged), 1 at the baseline. ``r_l`` is the MLP's distance relative to
    the attention's in the same layer, so a layer scale shared by both cancels.

    **Direction.** The paper reads a high ``C`` as "not converged" and reports that the deeper
    layers stay there ("deeper transformer layers are undertrained"). The claim under test is
    that such undertrained layers are the ones a model can spare, so the highest ``r_l`` (the
    most undertrained by this measure) is removed first: the score is ``-r_l``. If the claim
    holds, this criterion removes deep layers and beats ``random`` (and approaches
    ``block_influence``); if not, it does not. ``invert=True`` scores ``+r_l`` (the most
    converged layers go first), the control. Data-free.

    A mixture-of-experts layer's ``C_FF`` is the mean of its routed experts' (``C_FF_experts``).
    A layer without heads has no ``C_Q``; the mean over all heads of the model stands in
    (a model without heads raises). A zero denominator gives ``r = inf`` (``0`` if ``C_FF`` is 0 too):
    such a layer is removed first; :meth:`report` writes its ratio as ``None`` with the reason.

    .. code-block:: yaml

        criterion: sinv_depth
        unit: layers
        options: {invert: false}
    """

    units = ("layers",)

    def __init__(self, invert: bool = False):
        self.invert = bool(invert)
        self.ratios: list[float] | None = None

    def scores(self, model: nn.Module) -> list[float]:
        from sinv_prune.scoring.measures import head_measures

        has_experts = bool(get_adapter(model).expert_counts())
        values = head_measures(model, keys=["C_Q", "C_FF", *(["C_FF_experts"] if has_experts else [])])
        experts = values.get("C_FF_experts") or [[] for _ in values["C_FF"]]
        every = [float(v) for row in values["C_Q"] for v in row]
        if not every:
            raise ValueError("sinv_depth: the model has no attention heads, so no C_Q")
        fallback = math.fsum(every) / len(every)
        ratios = []
        for layer, (row, c_ff) in enumerate(zip(values["C_Q"], values["C_FF"], strict=True)):
            if c_ff is None and experts[layer]:  # a MoE layer: the mean over its routed experts
                c_ff = math.fsum(experts[layer]) / len(experts[layer])
            if c_ff is None:
                raise ValueError(f"sinv_depth: layer {layer} has no C_FF (no MLP linear path)")
            c_q = math.fsum(row) / len(row) if row else fallback
            ratios.append(c_ff / c_q if c_q > 0 else (math.inf if c_ff > 0 else 0.0))
        if any(math.isnan(r) for r in ratios):
            raise ValueError("sinv_depth: a measure is NaN (non-finite weights)")
        self.ratios = ratios
        return [r if self.invert else -r for r in ratios]

    def report(self) -> dict:
        """The ratios, JSON-safe: an infinite ratio is ``None`` and ``ratio_null`` says why."""
        ratios = self.ratios
        out: dict = {"invert": self.invert, "ratio": ratios}
        if ratios is not None and any(math.isinf(r) for r in ratios):
            out["ratio"] = [None if math.isinf(r) else r for r in ratios]
            layers = [i for i, r in enumerate(ratios) if math.isinf(r)]
            out["ratio_null"] = (
                f"layers {layers}: mean C_Q is 0 (the query and key slices cancel), so C_FF / C_Q is infinite; "
                "ranked as the highest ratio"
            )
        return out
