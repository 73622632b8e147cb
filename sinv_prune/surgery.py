"""Physical removal of attention heads through the architecture adapters."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from sinv_prune import compensation
from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.compensation import CompensationReport
from sinv_prune.record import PruningRecord, get_record, set_record


@dataclass
class LayerChange:
    """What happened to one layer: indices in the numbering before this call and the original one."""

    layer: int
    removed: list[int]
    removed_original: list[int]
    kept: int
    kept_kv: int


@dataclass
class PruneSummary:
    """Returned by :func:`prune_heads`: per-layer changes, parameter counts, compensation (when asked)."""

    layers: list[LayerChange]
    params_before: int
    params_after: int
    compensation: CompensationReport | None = None

    @property
    def heads_removed(self) -> int:
        return sum(len(c.removed) for c in self.layers)

    def to_dict(self) -> dict:
        data = {
            "params_before": self.params_before,
            "params_after": self.params_after,
            "heads_removed": self.heads_removed,
            "layers": [vars(c) for c in self.layers],
        }
        if self.compensation is not None:
            data["compensation"] = self.compensation.to_dict()
        return data

    def __str__(self) -> str:
        lines = [f"{'layer':>5} {'removed':>7} {'kept':>4} {'kv':>3}  removed (original numbering)"]
        for c in self.layers:
            lines.append(f"{c.layer:>5} {len(c.removed):>7} {c.kept:>4} {c.kept_kv:>3}  {c.removed_original}")
        ratio = self.params_after / self.params_before
        lines.append(f"parameters: {self.params_before:,} -> {self.params_after:,} ({ratio:.2%})")
        if self.compensation is not None:
            lines.append(str(self.compensation))
        return "\n".join(lines)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def prune_heads(
    model: nn.Module,
    heads: Mapping[int, Iterable[int]],
    *,
    allow_empty_layers: bool = False,
    calibration: Iterable[Mapping] | None = None,
    compensate: str | None = None,
    ridge: float = compensation.DEFAULT_RIDGE,
    add_bias: bool = False,
) -> PruneSummary:
    """Remove attention heads from ``model`` in place.

    ``heads`` maps a layer index to the query heads to remove, numbered as the layer
    has them now. Under grouped-query attention every KV group that keeps heads must
    keep the same number, and a KV head goes when all of its query heads go.
    ``allow_empty_layers=True`` permits removing every head of a layer; the attention
    block then contributes only its output bias. Invalid requests, quantized models and
    models with weights on the ``meta`` device (offloaded, or built under
    ``init_empty_weights``) raise ``ValueError`` before anything changes; any other
    error part-way through restores the model (weights, sizes, forwards, class and
    config) before it propagates. The config records the removed heads in the original
    numbering, so ``save_pretrained`` writes a checkpoint that reloads.

    Compensation (:mod:`sinv_prune.compensation`) re-fits what remains from ``calibration``
    (an iterable of batches: dicts with ``input_ids`` and optionally ``attention_mask``,
    whose padding is left out). ``compensate="lsq"`` refits each pruned layer's output
    projection (and its bias, where it has one) by ridge least squares, layer by layer on the
    already-pruned model's inputs, so that the layer reproduces the unpruned attention output;
    ``ridge`` is relative to the mean diagonal of the inputs' Gram matrix and pulls towards the
    plainly pruned weights. ``compensate="bias"`` (FLAP) adds the removed heads' mean
    contribution on the unpruned model to the output-projection bias. LLaMA-family output
    projections have no bias: ``add_bias=True`` gives every attention projection a zero bias
    and sets ``config.attention_bias`` (LLaMA, Qwen3; needed for ``"bias"``). The summary's
    ``compensation`` reports, per layer, the output projection's relative error before and
    after the refit. ``compensate=None`` (default) prunes exactly as without these arguments.
    """
    from sinv_prune.checkpoint import finalize_checkpoint_format

    adapter = get_adapter(model)
    refusal = unprunable_reason(model, adapter)
    if refusal:
        raise ValueError(f"cannot prune this model: {refusal}")
    compensation.check_options(model, adapter, compensate, calibration, ridge, add_bias)
    plan = plan_removal(adapter, heads, allow_empty_layers=allow_empty_layers)
    if not plan:  # nothing to remove: leave class and config as they are
        params = count_parameters(model)
        return PruneSummary([], params, params)
    inputs = compensation.capture_block_inputs(model, adapter, calibration) if compensate else None
    before = count_parameters(model)
    snapshot = _Snapshot.take(model, adapter, range(adapter.num_layers) if add_bias and compensate else plan)
    try:
        record = get_record(model.config) or _fresh_record(model, adapter)
        changes, report = [], None
        for layer, (removed, keep_q, keep_kv) in plan.items():
            kept_original = record.kept_heads(layer)
            removed_original = [kept_original[h] for h in removed]
            record.pruned_heads[layer] = sorted(set(record.pruned_heads.get(layer, [])) | set(removed_original))
            if not compensate:
                apply_layer(adapter, layer, keep_q, keep_kv)
            changes.append(LayerChange(layer, removed, removed_original, len(keep_q), len(keep_kv)))
        if compensate:
            cuts = compensation.head_cuts(adapter, plan, lambda layer: apply_layer(adapter, layer, *plan[layer][1:]))
            report = compensation.run_compensation(model, adapter, cuts, inputs, compensate, ridge, add_bias)
        set_record(model.config, record)
        finalize_checkpoint_format(model, adapter, record)
    except BaseException:
        snapshot.restore()
        raise
    return PruneSummary(changes, before, count_parameters(model), report)


def unprunable_reason(model: nn.Module, adapter: HeadAdapter) -> str | None:
    """Why slicing ``model``'s heads would go wrong (quantized or unmaterialized weights), or None."""
    quantizer = getattr(model, "hf_quantizer", None)
    quant_config = getattr(model.config, "quantization_config", None)
    if quantizer is not None or quant_config is not None or getattr(model, "is_quantized", False):
        method = _get(quant_config, "quant_method") or (type(quantizer).__name__ if quantizer else "unknown method")
        return (
            f"it is quantized ({getattr(method, 'value', method)}); prune the unquantized model "
            "(GGUF files load as float models through sinv_prune.from_pretrained)"
        )
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.device.type == "meta":
            return f"{name} is on the meta device (offloaded or never loaded); load every weight onto a real device"
    for layer in range(adapter.num_layers):
        for module in adapter.touched_modules(layer):
            for name, param in module.named_parameters():
                if type(param) is not nn.Parameter or not param.dtype.is_floating_point:
                    kind = f"{type(param).__name__} of dtype {str(param.dtype).removeprefix('torch.')}"
                    return f"layer {layer}: {name} is a {kind}, not a floating-point nn.Parameter (quantized?)"
    return None


def _get(obj, key: str):
    """``key`` of a dict or an attribute of an object (quantization configs come as either)."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


class _Snapshot:
    """References to everything :func:`prune_heads` may replace, to undo a failed call.

    Parameters are replaced, never written in place (see ``arch.base._replace``), so
    keeping the old objects costs no copy. Per touched module (submodules included) it
    keeps the attribute dict (sizes such as ``out_features``/``nf``, a replaced
    ``forward``) and the parameter, buffer and child dicts; plus the model's class and
    the config's attributes (head counts, record, ``architectures``, ``auto_map``).
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module]):
        self.model, self.cls = model, type(model)
        self.config = dict(vars(model.config))
        self.modules = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in modules]

    @classmethod
    def take(cls, model: nn.Module, adapter: HeadAdapter, layers: Iterable[int]) -> _Snapshot:
        modules = {id(m): m for layer in layers for top in adapter.touched_modules(layer) for m in top.modules()}
        return cls(model, list(modules.values()))

    def restore(self) -> None:
        for module, attrs, params, buffers, children in self.modules:
            _refill(vars(module), attrs)
            for live, saved in ((module._parameters, params), (module._buffers, buffers), (module._modules, children)):
                _refill(live, saved)
        _refill(vars(self.model.config), self.config)
        self.model.__class__ = self.cls


def _refill(live: dict, saved: dict) -> None:
    live.clear()
    live.update(saved)


def plan_removal(
    adapter: HeadAdapter, heads: Mapping[int, Iterable[int]], *, allow_empty_layers: bool = False
) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Validate a request; per layer: (removed, kept query heads, kept KV heads), current numbering."""
    if not isinstance(heads, Mapping):
        raise ValueError(f"heads must map layer index -> head indices, got {type(heads).__name__}")
    num_layers = adapter.num_layers
    plan, seen = {}, {}
    for raw_layer, raw_heads in sorted(heads.items(), key=lambda kv: _index(kv[0], "layer")):
        layer = _index(raw_layer, "layer")
        if not 0 <= layer < num_layers:
            raise ValueError(f"unknown layer {layer}: the model has layers 0..{num_layers - 1}")
        if layer in seen:
            raise ValueError(f"layer {layer} is named more than once (keys {raw_layer!r} and {seen[layer]!r})")
        seen[layer] = raw_layer
        layout = adapter.layout(layer)
        removed = [_index(h, f"head in layer {layer}") for h in _head_list(raw_heads, layer)]
        if len(set(removed)) != len(removed):
            dupes = sorted({h for h in removed if removed.count(h) > 1})
            raise ValueError(f"layer {layer}: duplicate head indices {dupes}")
        bad = [h for h in removed if not 0 <= h < layout.num_heads]
        if bad:
            raise ValueError(f"layer {layer}: head indices {bad} out of range 0..{layout.num_heads - 1}")
        if not removed:
            continue
        keep_q = [h for h in range(layout.num_heads) if h not in set(removed)]
        if not keep_q and not allow_empty_layers:
            raise ValueError(f"layer {layer}: removing all {layout.num_heads} heads needs allow_empty_layers=True")
        group = layout.group_size
        sizes = {kv: sum(1 for h in keep_q if h // group == kv) for kv in range(layout.num_kv_heads)}
        if len({s for s in sizes.values() if s}) > 1:
            raise ValueError(
                f"layer {layer}: GQA query groups would become unequal (heads kept per KV head: {list(sizes.values())})"
            )
        plan[layer] = (sorted(removed), keep_q, [kv for kv, s in sizes.items() if s])
    return plan


def apply_layer(adapter: HeadAdapter, layer: int, keep_q: list[int], keep_kv: list[int]) -> None:
    """Slice one layer to the given heads; an empty layer gets a forward that needs no heads."""
    device = adapter.out_proj(layer).weight.device
    adapter.slice_heads(
        layer,
        torch.tensor(keep_q, dtype=torch.long, device=device),
        torch.tensor(keep_kv, dtype=torch.long, device=device),
    )
    if not keep_q:
        adapter.attention(layer).forward = adapter.empty_forward(layer)


def _head_list(value, layer: int) -> list:
    """A layer's requested heads as a list; a bare index or a string is refused, not iterated."""
    if not isinstance(value, (str, bytes)):
        try:
            return list(value)
        except TypeError:
            pass
    raise ValueError(f"layer {layer}: heads must be a collection of head indices, got {value!r}")


def _index(value, what: str) -> int:
    if isinstance(value, (bool, float)):
        raise ValueError(f"{what} index must be an integer, got {value!r}")
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} index must be an integer, got {value!r}") from None


def _fresh_record(model: nn.Module, adapter: HeadAdapter) -> PruningRecord:
    layouts = {adapter.layout(i) for i in range(adapter.num_layers)}
    if len(layouts) != 1:
        raise ValueError("model has different head counts per layer but no sinv_prune record in its config")
    (layout,) = layouts
    base = type(model)
    while getattr(base, "_sinv_base", None) is not None:
        base = base._sinv_base
    return PruningRecord(
        base_class=base.__name__,
        num_layers=adapter.num_layers,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
    )
