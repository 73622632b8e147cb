"""Activation-aware head and MLP-channel scores from calibration batches: FLAP's fluctuation, or Wanda-style."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import linear_weight
from sinv_prune.scoring.criteria.base import Criterion, Scores, batch_to, model_device, observe
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.scoring.criteria.walk import walk_layers
from sinv_prune.units import get_unit
from sinv_prune.units.mlp import MLP

METRICS = ("fluctuation", "magnitude")


@register_criterion("activation")
class ActivationCriterion(Criterion):
    """What a head's output contributes to the attention block's output, measured on calibration batches.

    The input of each layer's output projection is the concatenation of the heads' outputs;
    a forward pre-hook reads it (eval mode, no gradients; tokens with ``attention_mask == 0``
    excluded) and keeps per channel, in float64, the sum and sum of squares over tokens, and
    per head the sum of its output's L2 norm: O(width) per layer, whatever the token count.
    With ``x_j`` channel ``j`` of the projection input and ``W_O[:, j]`` its column:

    * ``metric="fluctuation"`` (FLAP, An et al. 2024, "Fluctuation-based Adaptive Structured
      Pruning"): ``sum over the head's channels j of Var_t(x_j) * ||W_O[:, j]||^2``, the
      variance (over tokens, population form) that the head adds to the block's output if its
      channels are uncorrelated; a head whose output is nearly constant can be replaced by its
      mean (FLAP's bias compensation), so it goes first. FLAP standardises the scores of each
      layer before comparing layers; here they are compared as they are (``mode: per_layer``
      compares within layers only).
    * ``metric="magnitude"`` (Wanda-style): ``mean_t ||x_h(t)||_2 * ||W_O^h||_F``, the mean norm
      of the head's output times the norm of its output-projection columns.

    Higher = keep. Under GQA every query head is scored on its own (selection keeps groups
    valid). The weights are read when :meth:`scores` is called.

    ``unit="mlp"`` scores MLP channels the same way at the down projection's input
    (``adapter.mlp_out``), every channel a "head" of width 1 and ``W_O`` the down projection:
    ``metric="magnitude"`` is then Wanda's channel score, ``mean_t |x_j(t)| * ||W_down[:, j]||_2``
    (the mean absolute activation of the channel times its column norm), and
    ``metric="fluctuation"`` FLAP's ``Var_t(x_j) * ||W_down[:, j]||^2``.

    .. code-block:: yaml

        criterion: activation
        options: {metric: fluctuation}
    """

    needs_data = True
    units = ("heads", "mlp")

    def __init__(self, metric: str = "fluctuation"):
        if metric not in METRICS:
            raise ValueError(f"activation: unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
        self.metric = metric
        self.reset()

    def reset(self) -> None:
        self._stats: list[dict[str, torch.Tensor] | None] | None = None
        self.batches = 0
        self.tokens = 0

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        adapter = get_adapter(model)
        batch = batch_to(batch, model_device(model))
        batch.pop("labels", None)
        sites = self._sites(adapter)
        seen: dict[int, dict[str, torch.Tensor]] = {}
        hooks = [
            module.register_forward_pre_hook(_collect(seen, layer, groups, batch))
            for layer, (module, groups, _) in enumerate(sites)
            if groups
        ]
        observe(model, batch, hooks)
        self._merge(seen, [width for _, _, width in sites])

    walks_layers = True

    def update_layers(self, model: nn.Module, batches: list[Mapping[str, Any]]) -> None:
        """:meth:`update` over every batch, one block at a time (:mod:`~sinv_prune.scoring.criteria.walk`)."""
        sites = self._sites(get_adapter(model))
        seen: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in batches]

        def attach(layer: int, j: int, feed: dict) -> list:
            module, groups, _ = sites[layer]
            return [module.register_forward_pre_hook(_collect(seen[j], layer, groups, feed))] if groups else []

        walk_layers(model, batches, attach, desc="activation")
        for per_batch in seen:
            self._merge(per_batch, [width for _, _, width in sites])

    def scores(self, model: nn.Module) -> Scores:
        if self._stats is None:
            raise ValueError("activation: no batch seen; call update(model, batch) first")
        adapter = get_adapter(model)
        sites = self._sites(adapter)
        if len(sites) != len(self._stats):
            raise ValueError("activation: the layer count changed since the batches were seen; call reset()")
        out = []
        for layer, (stats, (module, groups, expected)) in enumerate(zip(self._stats, sites, strict=True)):
            width = 0 if stats is None else stats["sum"].numel()
            if width != expected:
                raise ValueError(
                    f"activation: {get_unit(self.unit).noun} counts changed since the batches were seen; call reset()"
                )
            if stats is None:
                out.append([])
                continue
            weight = linear_weight(module) if get_unit(self.unit) is MLP else adapter.projections(layer).o
            w_o = weight.detach().to(stats["sum"].device, torch.float64)  # [D, width]
            out.append(self._layer_scores(stats, w_o, groups))
        return out

    def _sites(self, adapter) -> list[tuple[nn.Module, int, int]]:
        """Per layer: the module whose input is read, its number of scored groups, and its input width."""
        if get_unit(self.unit) is MLP:
            moe = [layer for layer in range(adapter.num_layers) if adapter.num_experts(layer)]
            if moe:
                raise ValueError(
                    f"activation: layer {moe[0]} is a mixture-of-experts layer; activation scores dense MLP channels "
                    "only: score the channels inside experts with magnitude or random"
                )
            sizes = [adapter.intermediate_size(layer) for layer in range(adapter.num_layers)]
            return [(adapter.mlp_out(layer), n, n) for layer, n in enumerate(sizes)]
        layouts = [adapter.layout(layer) for layer in range(adapter.num_layers)]
        return [
            (adapter.out_proj(layer), lay.num_heads, lay.num_heads * lay.head_dim) for layer, lay in enumerate(layouts)
        ]

    def report(self) -> dict:
        return {"metric": self.metric, "batches": self.batches, "tokens": self.tokens}

    def _layer_scores(self, stats: dict[str, torch.Tensor], w_o: torch.Tensor, heads: int) -> list[float]:
        n = stats["tokens"]
        if not n:
            raise ValueError("activation: every token seen was padding (attention_mask == 0)")
        if self.metric == "fluctuation":
            mean = stats["sum"] / n
            variance = (stats["sumsq"] / n - mean.square()).clamp_min(0)
            score = (variance * w_o.square().sum(0)).reshape(heads, -1).sum(1)
        else:
            column_norms = w_o.reshape(w_o.shape[0], heads, -1).square().sum(dim=(0, 2)).sqrt()
            score = stats["norm_sum"] / n * column_norms
        return [float(x) for x in score.cpu()]

    def _merge(self, seen: dict[int, dict[str, torch.Tensor]], widths: list[int]) -> None:
        """Add one batch's statistics, checked against the ones already accumulated."""
        for layer, width in enumerate(widths):
            if width and layer not in seen:
                raise ValueError(f"activation: layer {layer}'s output projection was not called in the forward pass")
        stats = [seen.get(layer) for layer in range(len(widths))]
        if self._stats is None:
            self._stats = stats
        elif [0 if s is None else s["sum"].numel() for s in self._stats] != widths:
            raise ValueError(
                f"activation: {get_unit(self.unit).noun} counts changed between batches; call reset() after pruning"
            )
        else:
            for acc, new in zip(self._stats, stats, strict=True):
                if acc is not None:
                    for key in acc:
                        acc[key] = acc[key] + new[key]
        self.tokens += next((int(s["tokens"]) for s in stats if s is not None), 0)
        self.batches += 1


def _collect(store: dict, layer: int, heads: int, batch: Mapping[str, Any]):
    """A forward pre-hook keeping per-channel sums, sums of squares and per-head norm sums of valid tokens."""
    mask = batch.get("attention_mask")

    def hook(module, args):
        x = args[0].detach()
        if isinstance(mask, torch.Tensor):
            if tuple(mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(
                    f"activation: layer {layer}: attention_mask {tuple(mask.shape)} does not match the "
                    f"tokens {tuple(x.shape[:-1])} of the output projection's input"
                )
            x = x[mask.to(x.device) != 0]
        x = x.reshape(-1, x.shape[-1]).double()
        store[layer] = {
            "sum": x.sum(0),
            "sumsq": x.square().sum(0),
            "norm_sum": x.reshape(x.shape[0], heads, x.shape[1] // heads).norm(dim=-1).sum(0),
            "tokens": torch.tensor(x.shape[0], dtype=torch.float64),
        }

    return hook
