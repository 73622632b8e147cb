"""Physical removal of attention heads, MLP channels and whole blocks through the architecture adapters."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.surgery import compensation
from sinv_prune.surgery.checkpoint import base_class, dense_widths, expert_widths, finalize_checkpoint_format
from sinv_prune.surgery.compensation import CompensationReport
from sinv_prune.surgery.offload import (
    Ledger,
    apply_offload,
    check_offload,
    mark_offloaded,
    offloaded_reason,
    onloaded,
)
from sinv_prune.surgery.record import PruningRecord, get_record, set_record
from sinv_prune.surgery.shapes import drop_layers
from sinv_prune.surgery.store import PLACES, Store
from sinv_prune.surgery.unit import get_unit, unit_names, units

__all__ = ["PruneSummary", "count_parameters", "prune", "prune_heads"]


@dataclass
class PruneSummary:
    """Returned by :func:`prune`: per-layer changes, removed blocks, parameter counts, compensation (when asked).

    ``layers`` holds the head changes and ``mlp`` the channel changes, both keyed by the layer
    numbering before the call; ``removed_layers`` / ``removed_layers_original`` name the dropped
    blocks in that numbering and in the original one. ``removed(unit)`` reads any registered unit's
    entry (the unit's ``summary_field``), so code iterating over units need not know these fields. The
    changes are the units' own records of a layer (``LayerChange``, ``MlpChange``, ``ExpertChange`` in
    :mod:`sinv_prune.units`).
    """

    layers: list
    params_before: int
    params_after: int
    compensation: CompensationReport | None = None
    mlp: list = field(default_factory=list)
    removed_layers: list[int] = field(default_factory=list)
    removed_layers_original: list[int] = field(default_factory=list)
    experts: list = field(default_factory=list)

    @property
    def heads_removed(self) -> int:
        return sum(len(c.removed) for c in self.layers)

    @property
    def channels_removed(self) -> int:
        return sum(len(c.removed) for c in self.mlp)

    @property
    def experts_removed(self) -> int:
        return sum(len(c.removed) for c in self.experts)

    @property
    def layers_removed(self) -> int:
        return len(self.removed_layers)

    def removed(self, unit: str) -> Any:
        """What the registered ``unit`` lost, as its plan entry numbered as the model was before the call
        (``{layer: [items]}``; a whole-layer unit: ``[layers]``); each unit names the field it reads."""
        return get_unit(unit).removed(self)

    def to_dict(self) -> dict:
        data = {
            "params_before": self.params_before,
            "params_after": self.params_after,
            "heads_removed": self.heads_removed,
            "channels_removed": self.channels_removed,
            "layers_removed": self.layers_removed,
            "experts_removed": self.experts_removed,
            "layers": [vars(c) for c in self.layers],
            "mlp": [vars(c) for c in self.mlp],
            "experts": [vars(c) for c in self.experts],
            "removed_layers": list(self.removed_layers),
            "removed_layers_original": list(self.removed_layers_original),
        }
        if self.compensation is not None:
            data["compensation"] = self.compensation.to_dict()
        return data

    def __str__(self) -> str:
        lines = []
        if self.layers or not (self.mlp or self.experts or self.removed_layers):
            lines.append(f"{'layer':>5} {'removed':>7} {'kept':>4} {'kv':>3}  removed (original numbering)")
            for c in self.layers:
                lines.append(f"{c.layer:>5} {len(c.removed):>7} {c.kept:>4} {c.kept_kv:>3}  {c.removed_original}")
        if self.mlp:
            lines.append(f"{'layer':>5} {'channels removed':>16} {'kept':>5}")
            for c in self.mlp:
                lines.append(f"{c.layer:>5} {len(c.removed):>16} {c.kept:>5}")
        if self.experts:
            lines.append(f"{'layer':>5} {'experts removed':>15} {'kept':>4}  removed (original numbering)")
            for c in self.experts:
                lines.append(f"{c.layer:>5} {len(c.removed):>15} {c.kept:>4}  {c.removed_original}")
        if self.removed_layers:
            lines.append(f"layers removed: {self.removed_layers} (original numbering {self.removed_layers_original})")
        ratio = self.params_after / self.params_before
        lines.append(f"parameters: {self.params_before:,} -> {self.params_after:,} ({ratio:.2%})")
        if self.compensation is not None:
            lines.append(str(self.compensation))
        return "\n".join(lines)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


@dataclass
class _Plan:
    """A validated plan in the model's current numbering: per unit name, its checked entry."""

    entries: dict[str, object]

    def __bool__(self) -> bool:
        return any(self.entries.values())

    def per_layer(self) -> list[tuple[object, dict]]:
        """``(unit, checked entry)`` of the per-layer units the plan names, in cut order."""
        named = [(get_unit(name), entry) for name, entry in self.entries.items() if entry]
        return [(unit, entry) for unit, entry in named if not unit.whole_layers]

    @property
    def dropped(self) -> list[int]:
        """The whole layers the plan drops (current numbering, sorted)."""
        return sorted({i for name, entry in self.entries.items() if get_unit(name).whole_layers for i in entry})


def prune_heads(
    model: nn.Module,
    heads: Mapping[int, Iterable[int]],
    *,
    allow_empty_layers: bool = False,
    calibration: Iterable[Mapping] | None = None,
    compensate: str | None = None,
    ridge: float | None = None,
    add_bias: bool = False,
    precision: str = "float32",
    holdout: float = compensation.HOLDOUT,
    store: str = "cpu",
    target: str = "output",
) -> PruneSummary:
    """Remove attention heads from ``model`` in place: ``prune(model, {"heads": heads}, ...)``.

    ``heads`` maps a layer index to the query heads to remove, numbered as the layer
    has them now. Under grouped-query attention every KV group that keeps heads must
    keep the same number, and a KV head goes when all of its query heads go.
    ``allow_empty_layers=True`` permits removing every head of a layer; the attention
    block then contributes only its output bias. See :func:`prune` for validation,
    rollback, the record and compensation.
    """
    return prune(
        model,
        {"heads": heads},
        allow_empty_layers=allow_empty_layers,
        calibration=calibration,
        compensate=compensate,
        ridge=ridge,
        add_bias=add_bias,
        precision=precision,
        holdout=holdout,
        store=store,
        target=target,
    )


def prune(
    model: nn.Module,
    plan: Mapping[str, object],
    *,
    allow_empty_layers: bool = False,
    calibration: Iterable[Mapping] | None = None,
    compensate: str | None = None,
    ridge: float | None = None,
    add_bias: bool = False,
    precision: str = "float32",
    holdout: float = compensation.HOLDOUT,
    store: str = "cpu",
    offload: str = "none",
    offload_folder: str | None = None,
    target: str = "output",
    progress: bool = False,
) -> PruneSummary:
    """Remove attention heads, MLP channels and whole blocks from ``model`` in place, through one plan.

    ``plan`` is a mapping with any of these keys, every index in the model's numbering *now*
    (before this call; earlier calls' removals already applied):

    * ``"heads"``: ``{layer: [query heads]}``. Under grouped-query attention every KV group
      that keeps heads must keep the same number, and a KV head goes when all of its query
      heads go; removing every head of a layer needs ``allow_empty_layers=True`` (the
      attention then contributes only its output bias).
    * ``"mlp"``: ``{layer: [intermediate channels]}``: rows of the up (and gate) projection,
      columns of the down projection. A layer keeps at least one channel. On a mixture-of-experts
      layer the channels are those inside its experts, routed expert ``e``'s channel ``c`` as
      ``e * I + c`` then the shared expert's as ``E * I + c``; every routed expert loses as many
      (:mod:`sinv_prune.units.mlp`).
    * ``"layers"``: ``[layer, ...]``: whole blocks to drop (block output = block input). At
      least one block stays, and a removed block may not also be named under ``"heads"``
      or ``"mlp"``.

    A unit registered with :func:`sinv_prune.units.register_unit` adds its own key; every key is
    checked by its unit (:mod:`sinv_prune.units`), and an unknown one is refused naming it.

    Heads and channels are cut first, then blocks dropped; later layers move down and their
    attention ``layer_idx`` (KV-cache slot), ``config.num_hidden_layers`` / ``n_layer``,
    ``config.layer_types`` and ``max_window_layers`` follow. Invalid plans (unknown keys, bad
    or duplicate indices, empty MLPs, no block left, overlaps), quantized models and models
    with weights on the ``meta`` device raise a one-line ``ValueError`` before anything
    changes; any other error part-way through restores the model (weights, sizes, forwards,
    the block list, class and config) before it propagates. ``config.sinv_prune`` records
    every removal in the original numbering, so ``save_pretrained`` writes a checkpoint that
    reloads (stock class when the sizes are uniform and the config can state them, else
    remote code) and later calls compose.

    Compensation (:mod:`sinv_prune.surgery.compensation`) re-fits what remains from ``calibration``
    (an iterable of batches: dicts with ``input_ids`` and optionally ``attention_mask``,
    whose padding is left out). ``compensate="lsq"`` refits each pruned layer's attention
    output projection and MLP down projection (and their biases, where they have one) by
    ridge least squares, layer by layer on the already-pruned model's inputs, so that the
    layer reproduces the unpruned outputs; ``ridge`` is relative to the mean diagonal of the
    inputs' Gram matrix and pulls towards the plainly pruned weights (None, the default: each
    consumer picks one of ``compensation.RIDGES`` on the held-out tokens). ``holdout`` of the
    calibration sequences (default 1/8) are held out: each consumer keeps its refit only where
    it lowers the held-out error, and the compensated model is kept only where its held-out loss
    is below the plainly pruned model's (``summary.compensation.kept`` says which); ``holdout=0``
    fits on everything with ``compensation.default_ridge(tokens)``. ``compensate="obs"`` first
    re-chooses which units each layer loses (as many as planned; heads within each KV group, or which
    whole KV groups where the plan empties whole groups) by greedy OBS, then refits as ``"lsq"``;
    the summary and record give the units really removed. ``target="residual"`` (``"lsq"`` and ``"obs"``,
    pre-norm blocks of the LLaMA layout) fits each consumer to the unpruned model's residual stream after it
    instead of the unpruned consumer's output: the teacher's output plus the teacher's residual less the
    student's, so each refit also makes up for the error the blocks before it left (its block then reproduces
    the unpruned block's output as closely as least squares can); consumers with no such norm (MoE MLPs) keep
    the output target. ``progress``: a bar over the compensation's blocks (notes in a recipe's log).
    ``precision`` is the dtype of the statistics' products (float32, summed in float64; or
    float64). ``compensate="bias"``
    (FLAP) adds the removed units' mean contribution on the unpruned model to the consumer's
    bias; it is refused for MLP channels whose down projection has no bias (LLaMA family).
    LLaMA-family output projections have no bias: ``add_bias=True`` gives every attention
    projection a zero bias and sets ``config.attention_bias`` (LLaMA, Qwen3; needed for
    ``"bias"`` on heads). Dropped blocks need no compensation: heads and channels are
    compensated on the full stack, then the blocks go. The summary's ``compensation``
    reports, per consumer, its relative error before and after the refit.
    ``compensate=None`` (default) prunes exactly as without these arguments.

    ``store`` says where, until the call returns, the old weights of each cut block (the rollback)
    and the plainly pruned weights of refitted consumers wait: ``"cpu"`` (host memory; weights
    already there are kept by reference) or ``"disk"`` (files in a temporary folder, deleted on
    return), so the memory beyond the model stays flat whatever the depth
    (:mod:`sinv_prune.surgery.store`).

    ``offload="cpu"`` / ``"disk"`` first offloads the transformer blocks (host RAM, or files in
    ``offload_folder``) with accelerate, so that only the block being cut or refitted is on the
    compute device (:func:`~sinv_prune.surgery.offload.apply_offload`). A model already under
    accelerate's offload hooks (``device_map`` with ``"cpu"`` / ``"disk"`` entries, ``cpu_offload``)
    is pruned in place whatever ``offload`` says: each block's weights are brought in for its turn
    and the cut ones written back to the hook's weights map, where forwards and ``save_pretrained``
    read them (:mod:`sinv_prune.surgery.offload`).
    """
    if store not in PLACES:
        raise ValueError(f"store must be one of {', '.join(map(repr, PLACES))}, got {store!r}")
    check_offload(offload, offload_folder)
    adapter = get_adapter(model)
    apply_offload(model, offload, folder=offload_folder)
    refusal = unprunable_reason(model, adapter)
    if refusal:
        raise ValueError(f"cannot prune this model: {refusal}")
    compensation.check_options(model, adapter, compensate, calibration, ridge, add_bias, precision, holdout, target)
    checked = plan_prune(model, adapter, plan, allow_empty_layers=allow_empty_layers)
    for unit, entry in checked.per_layer():
        unit.check_compensation(model, adapter, entry, compensate)
    if not checked:  # nothing to remove: leave class and config as they are
        params = count_parameters(model)
        return PruneSummary([], params, params)
    record = _current_record(model, adapter)
    inputs = compensation.capture_block_inputs(model, adapter, calibration, holdout) if compensate else None
    before = count_parameters(model)
    held = Store(store)
    snapshot = _Snapshot.take(model, adapter, checked, held, all_attention=bool(add_bias and compensate))
    ledger = Ledger()  # writes to offloaded blocks' weight maps, undone with the snapshot
    try:
        options = (compensate, ridge, add_bias, precision, target, progress)
        with ledger.active():
            changes, report = _cut(model, adapter, record, checked, inputs, options, snapshot)
        origin = record.kept_layers()
        dropped = checked.dropped
        dropped_original = [origin[i] for i in dropped]
        if dropped:
            drop_layers(model, adapter, dropped)
            record.removed_layers = sorted(set(record.removed_layers) | set(dropped_original))
        set_record(model.config, record)
        finalize_checkpoint_format(model, adapter, record)
    except BaseException:
        snapshot.restore()
        ledger.undo()
        raise
    finally:
        held.close()
    mark_offloaded(model)  # save_pretrained then reads the offloaded (cut) weights through the hooks
    after = count_parameters(model)
    summary = PruneSummary([], before, after, report, removed_layers=dropped, removed_layers_original=dropped_original)
    for name, unit_changes in changes.items():
        setattr(summary, name, unit_changes)
    return summary


def _cut(model, adapter, record, plan: _Plan, inputs, options, snapshot: _Snapshot):
    """Slice every per-layer unit's entry (compensating when asked), updating ``record``; the changes
    per summary field and the compensation report.

    ``options`` is ``(compensate, ridge, add_bias, precision, target, progress)``. OBS may change which units go, so
    the record and the changes are written from the plan after compensation. After each block is cut,
    the old weights the rollback keeps of it move into its store (:meth:`_Snapshot.spill`).
    """
    compensate, ridge, add_bias, precision, target, progress = options
    report = None
    entries = plan.per_layer()
    if compensate:
        cuts: dict[int, list] = {}
        for unit, entry in entries:  # per layer in forward order: attention before the MLP

            def apply(layer: int, unit=unit, entry=entry) -> None:
                unit.cut(adapter, layer, entry[layer])

            def choose(layer: int, removed: list[int], unit=unit, entry=entry) -> None:
                entry[layer] = unit.rechoose(adapter, layer, entry[layer], removed)

            for layer, cut in unit.compensation_cuts(adapter, entry, apply, choose).items():
                cuts.setdefault(layer, []).extend(cut)
        report = compensation.run_compensation(
            model, adapter, dict(sorted(cuts.items())), inputs, compensate, ridge, add_bias, precision,
            snapshot.store, snapshot.spill, target, progress=progress,
        )  # fmt: skip
    else:
        blocks = adapter.layers()
        for unit, entry in entries:
            for layer in entry:
                with onloaded(blocks[layer]):  # offloaded weights come in for the cut and go back cut
                    unit.cut(adapter, layer, entry[layer])
                snapshot.spill()
    origin = record.kept_layers()
    changes: dict[str, list] = {}
    for unit, entry in entries:
        changes.setdefault(unit.summary_field, []).extend(unit.record_cut(record, origin, entry))
    return changes, report


def unprunable_reason(model: nn.Module, adapter: HeadAdapter) -> str | None:
    """Why slicing ``model``'s heads or MLPs would go wrong (quantized or unmaterialized weights), or None."""
    quantizer = getattr(model, "hf_quantizer", None)
    quant_config = getattr(model.config, "quantization_config", None)
    if quantizer is not None or quant_config is not None or getattr(model, "is_quantized", False):
        method = _get(quant_config, "quant_method") or (type(quantizer).__name__ if quantizer else "unknown method")
        return (
            f"it is quantized ({getattr(method, 'value', method)}); prune the unquantized model "
            "(GGUF files load as float models through sinv_prune.from_pretrained)"
        )
    reason = offloaded_reason(model)
    if reason:
        return f"{reason} (never loaded?); load every weight onto a real device, or offload it with accelerate"
    for layer in range(adapter.num_layers):
        for module in [*adapter.touched_modules(layer), *adapter.mlp_modules(layer)]:
            for name, param in module.named_parameters():
                if type(param) is not nn.Parameter or not param.dtype.is_floating_point:
                    kind = f"{type(param).__name__} of dtype {str(param.dtype).removeprefix('torch.')}"
                    return f"layer {layer}: {name} is a {kind}, not a floating-point nn.Parameter (quantized?)"
    return None


def _get(obj, key: str):
    """``key`` of a dict or an attribute of an object (quantization configs come as either)."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


@dataclass(frozen=True)
class _Spilled:
    """A saved parameter or buffer that waits in the rollback's store under ``key``."""

    key: tuple
    device: torch.device
    requires_grad: bool
    parameter: bool


class _Snapshot:
    """References to everything :func:`prune` may replace, to undo a failed call.

    Parameters are replaced, never written in place (see ``arch.base._replace``), so
    keeping the old objects costs no copy until the model lets go of them; then
    :meth:`spill` moves them into ``store`` (host memory, or disk), so the rollback of a deep
    model does not hold every cut block's old weights on the device. Per touched module (submodules included) it
    keeps the attribute dict (sizes such as ``out_features``/``nf``, a replaced
    ``forward``) and the parameter, buffer and child dicts; plus the model's class and
    the config's attributes (head and MLP sizes, layer count and ``layer_types``, record,
    ``architectures``, ``auto_map``). Dropping blocks covers the block list and every module
    in it (their ``layer_idx``).
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module], store: Store):
        self.model, self.cls, self.store = model, type(model), store
        self.config = dict(vars(model.config))
        self.modules = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in modules]

    @classmethod
    def take(
        cls, model: nn.Module, adapter: HeadAdapter, plan: _Plan, store: Store, all_attention: bool = False
    ) -> _Snapshot:
        every = range(adapter.num_layers) if all_attention else ()
        tops = [top for layer in every for top in adapter.touched_modules(layer)]
        tops += [m for unit, entry in plan.per_layer() for layer in entry for m in unit.touched(adapter, layer)]
        if plan.dropped:
            tops.append(adapter.layer_stack())
        modules = {id(m): m for top in tops for m in top.modules()}
        return cls(model, list(modules.values()), store)

    def spill(self) -> None:
        """Move the saved parameters and buffers the model no longer holds into the store (one entry each)."""
        live = {id(t) for t in itertools.chain(self.model.parameters(), self.model.buffers())}
        moved: dict[int, _Spilled] = {}  # a tensor saved by several modules is stored once
        for number, (_, _, params, buffers, _) in enumerate(self.modules):
            for kind, saved in (("parameter", params), ("buffer", buffers)):
                for name, value in saved.items():
                    if not isinstance(value, torch.Tensor) or value.is_meta or id(value) in live:
                        continue  # a meta tensor (an offloaded weight) costs nothing to keep
                    if id(value) not in moved:
                        key = (number, kind, name)
                        self.store.put(key, {"value": value})
                        is_param = isinstance(value, nn.Parameter)
                        moved[id(value)] = _Spilled(key, value.device, value.requires_grad, is_param)
                    saved[name] = moved[id(value)]

    def restore(self) -> None:
        loaded: dict[tuple, torch.Tensor] = {}
        for module, attrs, params, buffers, children in self.modules:
            _refill(vars(module), attrs)
            params, buffers = self._unspilled(params, loaded), self._unspilled(buffers, loaded)
            for live, saved in ((module._parameters, params), (module._buffers, buffers), (module._modules, children)):
                _refill(live, saved)
        _refill(vars(self.model.config), self.config)
        self.model.__class__ = self.cls

    def _unspilled(self, saved: dict, loaded: dict[tuple, torch.Tensor]) -> dict:
        """``saved`` with every spilled entry read back from the store (one object per stored tensor)."""
        out = dict(saved)
        for name, value in saved.items():
            if isinstance(value, _Spilled):
                if value.key not in loaded:
                    tensor = self.store.get(value.key, value.device)["value"]
                    if value.parameter:
                        tensor = nn.Parameter(tensor, requires_grad=value.requires_grad)
                    loaded[value.key] = tensor
                out[name] = loaded[value.key]
        return out


def _refill(live: dict, saved: dict) -> None:
    live.clear()
    live.update(saved)


def plan_prune(
    model: nn.Module, adapter: HeadAdapter, plan: Mapping[str, object], *, allow_empty_layers: bool = False
) -> _Plan:
    """Validate a :func:`prune` plan (current numbering) with a one-line ``ValueError``; nothing changes.

    Every key is a registered unit (:mod:`sinv_prune.units`); each unit checks its own entry, and no
    per-layer unit may name a layer a whole-layer unit drops."""
    names = unit_names()
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan must be a mapping with keys {', '.join(names)}, got {type(plan).__name__}")
    unknown = [k for k in plan if k not in names]
    if unknown:
        raise ValueError(f"unknown plan keys {unknown}: a plan has {', '.join(map(repr, names))}")
    entries = {
        unit.name: unit.validate(model, adapter, plan.get(unit.name), allow_empty_layers=allow_empty_layers)
        for unit in units()
        if unit.name in plan
    }
    checked = _Plan(entries)
    for unit, entry in checked.per_layer():
        overlap = sorted(set(entry) & set(checked.dropped))
        if overlap:
            raise ValueError(f"layers {overlap} are removed by the plan and also have {unit.described} named")
    return checked


def _current_record(model: nn.Module, adapter: HeadAdapter) -> PruningRecord:
    """The model's record (records from before MLP pruning get their MLP width), or a fresh one."""
    record = get_record(model.config)
    if record is None:
        return fresh_record(model, adapter)
    if len(record.kept_layers()) != adapter.num_layers:
        raise ValueError(
            f"the pruning record keeps {len(record.kept_layers())} layers but the model has {adapter.num_layers}"
        )
    if record.intermediate_size is None:  # written before MLP pruning existed: the MLPs are whole
        record.intermediate_size = _uniform_width(adapter)
    if record.num_experts is not None and record.expert_width is None:  # no channel inside an expert cut yet
        record.expert_width, record.shared_expert_width = _uniform_expert_widths(adapter)
    return record


def _uniform_width(adapter: HeadAdapter) -> int | None:
    """The dense layers' one MLP width (None: every layer is a mixture of experts)."""
    widths = dense_widths(adapter)
    if len(widths) > 1:
        raise ValueError("model has different MLP widths per layer but no sinv_prune record of them in its config")
    return next(iter(widths), None)


def fresh_record(model: nn.Module, adapter: HeadAdapter) -> PruningRecord:
    """The record an unpruned ``model`` would start with (its original shapes, nothing removed)."""
    layouts = {adapter.layout(i) for i in range(adapter.num_layers)}
    if len(layouts) != 1:
        raise ValueError("model has different head counts per layer but no sinv_prune record in its config")
    (layout,) = layouts
    expert_width, shared_width = _uniform_expert_widths(adapter)
    return PruningRecord(
        base_class=base_class(type(model)).__name__,
        num_layers=adapter.num_layers,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        intermediate_size=_uniform_width(adapter),
        num_experts=_uniform_experts(adapter),
        expert_width=expert_width,
        shared_expert_width=shared_width,
    )


def _uniform_experts(adapter: HeadAdapter) -> int | None:
    """The MoE layers' one routed-expert count (None: a dense model)."""
    counts = set(adapter.expert_counts())
    if len(counts) > 1:
        raise ValueError("model has different expert counts per layer but no sinv_prune record of them in its config")
    return next(iter(counts), None)


def _uniform_expert_widths(adapter: HeadAdapter) -> tuple[int | None, int | None]:
    """The MoE layers' one routed-expert width and one shared-expert width (None: none of either)."""
    widths, shared = expert_widths(adapter)
    if len(widths) > 1 or len(shared) > 1:
        raise ValueError("model has different expert widths per layer but no sinv_prune record of them in its config")
    return next(iter(widths), None), next(iter(shared), None)
