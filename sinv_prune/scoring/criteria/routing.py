"""Expert scores from what the routers do on calibration text: ``frequency``, ``reap``, ``ean``.

Each MoE layer's router returns its logits for the layer's tokens, and the layer's experts module is
called with those tokens ``x`` ``[T, H]`` and the top-k experts the router picked for each
(``top_k_index`` ``[T, k]``; GPT-OSS: ``router_indices``). A forward hook on the router keeps the logits, a
forward pre-hook on the experts module reads the rest (eval mode, no gradients; tokens with
``attention_mask == 0`` left out) and, for ``reap`` and ``ean``, recomputes each routed expert's output
``f_e(x)`` through the adapter's ``expert_output`` (``W_down^e (act(W_gate^e x) * W_up^e x)`` for the
Qwen-MoE, Mixtral and OLMoE families; GPT-OSS's biased, clamped SwiGLU experts as its experts module
computes them) in float32 (float64 for float64 models). Per
expert it keeps, in float64, the number of tokens routed to it, the sum of ``||f_e(x)||_2`` and the
sum of ``g_e(x) ||f_e(x)||_2``, ``g_e(x)`` the router's softmax probability of ``e`` (REAP's gate
value): O(experts) per layer, whatever the token count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.criteria.base import Criterion, Scores, batch_to, model_device, observe, unit_counts
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.scoring.criteria.walk import walk_layers

STATS = ("routed", "norm_sum", "gated_norm_sum")


class RoutingCriterion(Criterion):
    """Common part of the routing criteria: hooks, accumulation, checks; subclasses turn the sums into scores."""

    needs_data = True
    units = ("experts",)
    #: Whether the scores need the experts' outputs (``frequency`` only counts).
    uses_outputs: ClassVar[bool] = True
    #: Whether the scores need the gate values (the router's logits).
    uses_gates: ClassVar[bool] = False
    #: Gate values divided by their sum over the token's top k (REAP's ``renormalize_router_weights``).
    renormalize: bool = False

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._stats: list[dict[str, torch.Tensor] | None] | None = None
        self.batches = 0
        self.tokens = 0

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        adapter = get_adapter(model)
        batch = batch_to(batch, model_device(model))
        batch.pop("labels", None)
        counts = self._expert_counts(model)
        seen: dict[int, dict[str, torch.Tensor]] = {}
        logits: dict[int, torch.Tensor] = {}
        mask = batch.get("attention_mask")
        moe = [layer for layer, n in enumerate(counts) if n]
        hooks = [hook for layer in moe for hook in self._hooks(adapter, layer, seen, logits, mask)]
        observe(model, batch, hooks)
        self._merge(seen, counts)

    walks_layers = True

    def update_layers(self, model: nn.Module, batches: list[Mapping[str, Any]]) -> None:
        """:meth:`update` over every batch, one block at a time (:mod:`~sinv_prune.scoring.criteria.walk`)."""
        adapter = get_adapter(model)
        counts = self._expert_counts(model)
        seen: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in batches]
        logits: list[dict[int, torch.Tensor]] = [{} for _ in batches]
        moe = [layer for layer, n in enumerate(counts) if n]

        def attach(layer: int, j: int, feed: dict) -> list:
            if not counts[layer]:
                return []
            return self._hooks(adapter, layer, seen[j], logits[j], feed.get("attention_mask"))

        walk_layers(model, batches, attach, layers=moe, desc=self.name)
        for per_batch in seen:
            self._merge(per_batch, counts)

    def _expert_counts(self, model: nn.Module) -> list[int]:
        counts = unit_counts(model, "experts")
        if not any(counts):
            raise ValueError(f"{self.name}: the model has no mixture-of-experts layers: there are no experts to score")
        return counts

    def _hooks(self, adapter, layer: int, seen: dict, logits: dict, mask) -> list:
        """The hooks of one MoE layer for one batch: the router's logits (where gates count), the experts' sums."""
        hooks = [adapter.router(layer).register_forward_hook(_keep_logits(logits, layer))] if self.uses_gates else []
        collect = _collect(seen, logits, adapter, layer, mask, self)
        return [*hooks, adapter.experts(layer).register_forward_pre_hook(collect, with_kwargs=True)]

    def scores(self, model: nn.Module) -> Scores:
        if self._stats is None:
            raise ValueError(f"{self.name}: no batch seen; call update(model, batch) first")
        if self._counts() != unit_counts(model, "experts"):
            raise ValueError(f"{self.name}: expert counts changed since the batches were seen; call reset()")
        if not self.tokens:
            raise ValueError(f"{self.name}: every token seen was padding (attention_mask == 0)")
        return [[] if s is None else [float(x) for x in self._layer_scores(s).cpu()] for s in self._stats]

    def report(self) -> dict:
        stats = self._stats or []
        routed = [[] if s is None else [int(x) for x in s["routed"].tolist()] for s in stats]
        never = {layer: [e for e, n in enumerate(row) if not n] for layer, row in enumerate(routed)}
        return {
            "batches": self.batches,
            "tokens": self.tokens,
            "routed_tokens": routed,
            "never_routed": {layer: experts for layer, experts in never.items() if experts},
        }

    def _layer_scores(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _counts(self) -> list[int]:
        return [0 if s is None else s["routed"].numel() for s in self._stats or []]

    def _merge(self, seen: dict[int, dict[str, torch.Tensor]], counts: list[int]) -> None:
        """Add one batch's sums, checked against those already accumulated."""
        missing = [layer for layer, n in enumerate(counts) if n and layer not in seen]
        if missing:
            raise ValueError(f"{self.name}: the experts of layers {missing} were not called in the forward pass")
        stats = [seen.get(layer) for layer in range(len(counts))]
        if self._stats is None:
            self._stats = stats
        elif self._counts() != counts:
            raise ValueError(f"{self.name}: expert counts changed between batches; call reset() after pruning")
        else:
            for acc, new in zip(self._stats, stats, strict=True):
                if acc is not None:
                    for key in STATS:
                        acc[key] = acc[key] + new[key]
        self.tokens += next(int(s["tokens"]) for s in stats if s is not None)
        self.batches += 1


@register_criterion("frequency")
class FrequencyCriterion(RoutingCriterion):
    """How often the router picks the expert: the share of calibration tokens routed to it.

    Score = (tokens whose top-k includes the expert) / (tokens seen), padding excluded; an expert never
    picked scores 0 and goes first. The experts' outputs are not computed. Data: calibration batches.

    .. code-block:: yaml

        criterion: frequency
    """

    uses_outputs = False

    def _layer_scores(self, stats):
        return stats["routed"] / self.tokens


@register_criterion("reap")
class ReapCriterion(RoutingCriterion):
    """REAP, router-weighted expert activation pruning (Lasby et al. 2025, Cerebras, "REAP the Experts:
    Why Pruning Prevails for One-Shot MoE Compression").

    Score of expert ``e`` = the mean, over the calibration tokens routed to it, of its gate value
    times the norm of its output, ``mean_{x routed to e} g_e(x) ||f_e(x)||_2``: how much the expert
    adds to the layer's output when it is used, however often that is. An expert never routed scores
    0 and goes first. ``g_e(x)`` is the router's softmax probability of ``e`` over all experts;
    renormalised, it is divided by the sum over the token's top k (the authors'
    ``renormalize_router_weights``), the weight the layer applies where the model renormalises
    (Mixtral; Qwen-MoE and OLMoE with ``norm_topk_prob``; GPT-OSS, whose softmax over the top-k logits
    equals it). ``renormalize=None`` (the default) decides as the authors' code does since their
    "Renorm router logits by default": renormalised where the model's config sets ``norm_topk_prob``
    (Qwen3-MoE checkpoints), the plain softmax otherwise (Mixtral and GPT-OSS included: their configs
    have no ``norm_topk_prob``); ``true`` / ``false`` force either. Data: calibration batches.

    .. code-block:: yaml

        criterion: reap
        options: {renormalize: null}
    """

    uses_gates = True

    def __init__(self, renormalize: bool | None = None):
        if renormalize is not None and not isinstance(renormalize, bool):
            raise ValueError(
                f"reap: renormalize must be true, false or null (the model's norm_topk_prob), got {renormalize!r}"
            )
        #: The option as given; ``renormalize`` is what the batches seen so far were scored with.
        self.option = renormalize
        self.renormalize = bool(renormalize)
        super().__init__()

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        self.renormalize = default_renormalize(model) if self.option is None else self.option
        super().update(model, batch)

    def update_layers(self, model: nn.Module, batches: list[Mapping[str, Any]]) -> None:
        self.renormalize = default_renormalize(model) if self.option is None else self.option
        super().update_layers(model, batches)

    def report(self) -> dict:
        gate = "softmax probability / its sum over the top k" if self.renormalize else "softmax probability"
        return {**super().report(), "gate": gate}

    def _layer_scores(self, stats):
        return torch.where(stats["routed"] > 0, stats["gated_norm_sum"] / stats["routed"].clamp_min(1), 0.0)


@register_criterion("ean")
class EanCriterion(RoutingCriterion):
    """EAN, expert activation norm: the sum, over the calibration tokens routed to the expert, of
    ``||f_e(x)||_2`` (no gate weight), so frequent and strong experts score high. An expert never
    routed scores 0. Data: calibration batches.

    .. code-block:: yaml

        criterion: ean
    """

    def _layer_scores(self, stats):
        return stats["norm_sum"].clone()


def default_renormalize(model: nn.Module) -> bool:
    """REAP's default gate (the authors' code): the top-k-renormalised weight where ``config.norm_topk_prob`` is
    set, the plain softmax probability otherwise."""
    return bool(getattr(model.config, "norm_topk_prob", False))


def _inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index)`` of an experts call, positional or by keyword (GPT-OSS names the
    index ``router_indices``)."""
    names = ("hidden_states", "top_k_index")
    values = list(args[:2]) + [kwargs.get(name) for name in names[len(args[:2]) :]]
    if len(args) < 2 and values[1] is None:
        values[1] = kwargs.get("router_indices")
    if any(not isinstance(v, torch.Tensor) for v in values):
        raise ValueError(f"experts module called without ({', '.join(names)})")
    return values[0], values[1]


def _keep_logits(store: dict, layer: int):
    """A forward hook on one layer's router keeping its logits ``[T, E]`` (its first output)."""

    def hook(module, args, output):
        store[layer] = output[0].detach()

    return hook


def _collect(store: dict, logits: dict, adapter, layer: int, mask, criterion: RoutingCriterion):
    """A forward pre-hook on one layer's experts module keeping per-expert counts and output-norm sums."""
    name = criterion.name

    def hook(module, args, kwargs):
        hidden, index = (t.detach() for t in _inputs(args, kwargs))
        gates = None
        if criterion.uses_gates:
            if layer not in logits:
                raise ValueError(f"{name}: layer {layer}: the experts ran before the router")
            gates = torch.softmax(logits.pop(layer).to(hidden.device, torch.float64), dim=-1)
            if criterion.renormalize:
                gates = gates / gates.gather(1, index).sum(-1, keepdim=True)
        if isinstance(mask, torch.Tensor):
            if mask.numel() != hidden.shape[0]:
                raise ValueError(
                    f"{name}: layer {layer}: attention_mask {tuple(mask.shape)} does not match the "
                    f"{hidden.shape[0]} tokens of the experts' input"
                )
            keep = mask.reshape(-1).to(hidden.device) != 0
            hidden, index = hidden[keep], index[keep]
            gates = None if gates is None else gates[keep]
        count = adapter.num_experts(layer)
        routed = torch.zeros(count, dtype=torch.float64, device=hidden.device)
        norm_sum, gated_sum = torch.zeros_like(routed), torch.zeros_like(routed)
        routed.index_add_(0, index.reshape(-1), torch.ones(index.numel(), dtype=torch.float64, device=hidden.device))
        if criterion.uses_outputs:
            dtype = torch.float64 if adapter.expert_weights(layer)[0].dtype == torch.float64 else torch.float32
            for expert in routed.nonzero().flatten().tolist():
                token = torch.where(index == expert)[0]
                norms = adapter.expert_output(layer, expert, hidden[token].to(dtype)).norm(dim=-1).double()
                norm_sum[expert] = norms.sum()
                if gates is not None:
                    gated_sum[expert] = (gates[token, expert] * norms).sum()
        store[layer] = {
            "routed": routed,
            "norm_sum": norm_sum,
            "gated_norm_sum": gated_sum,
            "tokens": torch.tensor(hidden.shape[0]),
        }

    return hook


def layer_hooks(criterion: RoutingCriterion, model: nn.Module, layer: int, seen: dict) -> tuple:
    """The hooks :meth:`RoutingCriterion.update` puts on MoE layer ``layer``, unregistered, to run it alone.

    ``(router forward hook or None, experts forward pre-hook with kwargs)``: a forward of the layer puts
    its sums in ``seen[layer]``; add them up over batches with :func:`add_layer_sums`, turn them into
    scores with :func:`layer_scores` (layer-wise calibration: :mod:`sinv_prune.surgery.layerwise`). REAP's gate is
    decided here from ``model`` as :meth:`ReapCriterion.update` decides it (``renormalize=None``: the config's
    ``norm_topk_prob``).
    """
    adapter = get_adapter(model)
    if isinstance(criterion, ReapCriterion):  # the gate the model's config calls for, as update() decides it
        criterion.renormalize = default_renormalize(model) if criterion.option is None else criterion.option
    logits: dict[int, torch.Tensor] = {}
    router = _keep_logits(logits, layer) if criterion.uses_gates else None
    return router, _collect(seen, logits, adapter, layer, None, criterion)


def add_layer_sums(total: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's sums of a batch added to those of the batches before (None: the first)."""
    if total is None:
        return dict(new)
    return {key: total[key] + new[key] for key in (*STATS, "tokens")}


def layer_scores(criterion: RoutingCriterion, sums: dict[str, torch.Tensor]) -> list[float]:
    """The criterion's scores of one layer's experts from its sums over every batch."""
    if criterion.name == "frequency":
        raise ValueError("frequency: layer_scores needs the token count of every layer; use scores()")
    return [float(x) for x in criterion._layer_scores(sums).cpu()]
