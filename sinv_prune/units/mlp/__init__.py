"""MLP channels: the intermediate channels of each layer's MLP (up / gate rows, down columns).

On a mixture-of-experts layer the items are the channels inside its experts: routed expert ``e``'s
channel ``c`` is item ``e * I + c`` (``I`` the current expert width), then the shared expert's
channel ``c`` (Qwen2-MoE) is item ``E * I + c``. The fused expert weights need one width, so every
routed expert of a layer loses the same number of channels (each its own ones), and a cut expert keeps
a multiple of :data:`EXPERT_ALIGN` (the ``grouped_mm`` experts kernel's alignment); the shared expert
keeps at least one. Removal is exact: the pruned model computes what the original
computes with those channels' down-projection columns zeroed.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

from torch import nn

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.log_level import log_level
from sinv_prune.surgery.checkpoint import expert_widths
from sinv_prune.surgery.record import PruningRecord
from sinv_prune.surgery.unit import Unit, nonnegative, per_layer, register_unit, score_rows
from sinv_prune.units.mlp.cuts import apply_expert_channels, apply_mlp, mlp_cuts
from sinv_prune.units.mlp.gates import channel_gates
from sinv_prune.units.mlp.selection import quarter, removal_counts, select_channels


class MlpUnit(Unit):
    """MLP channels, ``{layer: [channels]}``; a layer keeps at least one; ``multiple`` keeps widths a multiple of m."""

    name = "mlp"
    noun = "channel"
    plural = "channels"
    settings = {"multiple": 1}
    recipe_keys = {"multiple": "multiple", "min_channels_per_layer": "min_per_layer"}

    def sizes(self, model: nn.Module) -> list[int]:
        adapter = get_adapter(model)
        return [layer_width(adapter, layer) for layer in range(adapter.num_layers)]

    def cost(self, model: nn.Module, layer: int) -> int:
        adapter = get_adapter(model)
        geometry = moe_geometry(adapter, layer)
        if geometry is not None:  # a gate and an up row (and biases, GPT-OSS), a down column; routed or shared
            experts = adapter.experts(layer)
            names = ("gate_up_proj", "gate_up_proj_bias", "down_proj")
            weights = sum(getattr(experts, n).numel() for n in names if getattr(experts, n, None) is not None)
            return weights // (geometry.experts * geometry.width)
        return channel_cost(model, layer)

    def gates(self, model: nn.Module, *, requires_grad: bool = True) -> AbstractContextManager[list]:
        return channel_gates(model, requires_grad=requires_grad)

    def check_part(self, part) -> None:
        super().check_part(part)
        if isinstance(part.multiple, bool) or nonnegative(part.multiple, "multiple") < 1:
            raise ValueError(f"multiple must be a positive integer, got {part.multiple!r}")

    def allowed(self, model, layer, row, min_per_layer, multiple, shape):
        adapter = get_adapter(model)
        if moe_geometry(adapter, layer) is not None:
            raise ValueError(
                f"layer {layer} is a mixture-of-experts layer: a non-uniform allocation spreads dense MLP channels "
                "only; prune the channels inside experts with allocation 'uniform'"
            )
        width = adapter.intermediate_size(layer)
        if len(row) != width:
            raise ValueError(f"layer {layer}: {len(row)} scores for {width} channels")
        least = quarter(width) if min_per_layer is None else min_per_layer
        return removal_counts(width, least, multiple), None

    def validate(self, model, adapter, entry, *, allow_empty_layers=False):
        return plan_channels(adapter, {} if entry is None else entry)

    def select(self, model, part, scores, amount, kept, exact):
        sizes = self.sizes(model)
        rows = score_rows(scores, len(sizes), self.name)
        kept = [layer for layer in kept if sizes[layer]]
        chosen = select_channels(
            [sizes[layer] for layer in kept],
            [rows[layer] for layer in kept],
            amount,
            mode=part.mode,
            min_channels_per_layer=part.min_per_layer,
            multiple=part.multiple,
            seed=part.seed,
            exact=exact,
        )
        chosen = {kept[i]: channels for i, channels in chosen.items()}
        floors = [_least(part.min_per_layer, part.mode, sizes[layer]) for layer in kept]
        return within_experts(get_adapter(model), chosen, rows, kept, dict(zip(kept, floors, strict=True)),
                              part.multiple, part.seed, exact)  # fmt: skip

    def check_amount(self, adapter, amount, options) -> None:
        widths = [w for w in (layer_width(adapter, layer) for layer in range(adapter.num_layers)) if w]
        if not widths:
            raise ValueError("the model has no MLP channels")
        layers, total = len(widths), sum(widths)
        keep = options.get("min_per_layer", 1)
        most = total - keep * layers
        if isinstance(amount, int) and amount > most:
            raise ValueError(
                f"{amount} MLP channels requested, at most {most} can go "
                f"({total} in {layers} layers, {keep} kept per layer)"
            )

    def select_round(self, model, part, scores, share, remaining, kept, start_sizes):
        """``share`` channels (or the nearest achievable below; else up to ``remaining``); ``{}`` if none.

        Floors are those of the widths at the start: a quarter of each in ``global`` mode unless the
        part sets ``min_per_layer``, so rounds do not starve a layer one quarter at a time.
        """
        sizes = self.sizes(model)
        rows = score_rows(scores, len(sizes), self.name)
        keep = [i for i, layer in enumerate(kept) if sizes[layer]]
        kept, start_sizes = [kept[i] for i in keep], [start_sizes[i] for i in keep]
        floor = part.min_per_layer
        if floor is None and part.mode == "global":
            floor = [quarter(n) for n in start_sizes]
        for request in (share, remaining):
            try:
                with log_level(select_channels.__module__, logging.ERROR):  # a share the multiple misses: ours
                    chosen = select_channels([sizes[i] for i in kept], [rows[i] for i in kept], request,
                                             mode=part.mode, min_channels_per_layer=floor, multiple=part.multiple,
                                             seed=part.seed)  # fmt: skip
            except ValueError:
                continue
            chosen = {kept[i]: channels for i, channels in chosen.items()}
            floors = floor if isinstance(floor, list) else [_least(floor, part.mode, sizes[i]) for i in kept]
            return within_experts(get_adapter(model), chosen, rows, kept, dict(zip(kept, floors, strict=True)),
                                  part.multiple, part.seed, False)  # fmt: skip
        return {}

    def original_items(self, record, adapter, layer, orig):
        geometry = moe_geometry(adapter, layer)
        if geometry is not None:
            return moe_items(record, geometry, orig)
        known = record is not None and record.intermediate_size  # older records: unpruned MLPs
        return record.kept_channels(orig) if known else list(range(adapter.intermediate_size(layer)))

    def change(self, adapter, layer, where, gone, now, kept):
        return MlpChange(layer, where, gone, len(kept))

    summary_field = "mlp"
    described = "MLP channels"
    record_field = "pruned_mlp"
    card_label = "MLP"

    def recorded(self, record):
        """Removed channels per original layer: dense ones, or (MoE layers) items ``e * width + c``."""
        return {**record.pruned_mlp, **record.pruned_expert_channels}

    def info(self, record, layer):
        if layer in record.pruned_expert_channels:
            kept = record.kept_experts(layer)
            width = len(record.kept_expert_channels(layer, kept[0])) if kept else 0
            text = f"  expert channels kept {width}/{record.expert_width} per expert"
            if record.shared_expert_width:
                text += f", shared {len(record.kept_shared_channels(layer))}/{record.shared_expert_width}"
            return text
        if not record.pruned_mlp:
            return ""
        return f"  MLP channels kept {len(record.kept_channels(layer))}/{record.intermediate_size}"

    def card_text(self, record):
        kept = record.kept_layers()
        moe = record.num_experts is not None  # the record does not say which layers are dense: the cut ones
        dense = [i for i in kept if i in record.pruned_mlp] if moe else kept
        phrases = []
        if record.pruned_mlp and dense:
            width = _span({len(record.kept_channels(i)) for i in dense})
            where = "in the pruned dense layers" if moe else "per remaining layer"
            phrases.append(f"{width} of {record.intermediate_size} MLP channels kept {where}")
        cut = [i for i in kept if i in record.pruned_expert_channels]
        if cut:
            width = _span({len(record.kept_expert_channels(i, record.kept_experts(i)[0])) for i in cut})
            phrases.append(f"{width} of {record.expert_width} channels kept per expert in the pruned MoE layers")
        return "; ".join(phrases)

    def check_compensation(self, model, adapter, checked, compensate) -> None:
        moe = [i for i, entry in checked.items() if isinstance(entry, ExpertChannels)]
        if compensate is not None and moe:
            raise ValueError(
                f"compensate={compensate!r} refits a dense MLP's down projection; layers {moe[:5]} cut channels "
                "inside experts: prune them with compensate=None"
            )
        if compensate != "bias":
            return
        no_bias = [i for i in checked if getattr(adapter.mlp_out(i), "bias", None) is None]
        if no_bias:
            raise ValueError(
                f"compensate='bias' needs an MLP down-projection bias, which {model.config.model_type} lacks "
                f"(layers {no_bias[:5]}); use compensate='lsq' for MLP channels"
            )

    def touched(self, adapter: HeadAdapter, layer: int) -> list[nn.Module]:
        return adapter.mlp_modules(layer)

    def rebuild(self, adapter: HeadAdapter, layer: int, orig: int, record: PruningRecord) -> None:
        if record.pruned_expert_channels.get(orig):
            rebuild_experts(adapter, layer, orig, record)
        elif record.pruned_mlp.get(orig):
            apply_mlp(adapter, layer, record.kept_channels(orig))

    def cut(self, adapter: HeadAdapter, layer: int, checked) -> None:
        if isinstance(checked, ExpertChannels):
            routed, shared = checked.split()
            apply_expert_channels(adapter, layer, routed, shared)
        else:
            apply_mlp(adapter, layer, checked[1])

    # -- reload routes (MoE layers: expert widths) ------------------------------------------------

    def stock_refusal(self, adapter: HeadAdapter, record: PruningRecord) -> str | None:
        if not record.pruned_expert_channels:
            return None
        widths, shared = expert_widths(adapter)
        if len(widths) > 1 or len(shared) > 1:
            return (
                "MoE layers keep different expert widths, which stock classes (and vLLM and llama.cpp, which read "
                "one width) cannot describe"
            )
        return None

    def state_config(self, model: nn.Module, adapter: HeadAdapter, record: PruningRecord, stock: bool) -> None:
        """Set the config's expert widths: the kept ones on the stock route, the original on the remote-code one."""
        if not record.pruned_expert_channels:
            return
        widths, shared = expert_widths(adapter)
        width = next(iter(widths)) if stock and widths else record.expert_width
        setattr(model.config, adapter.config_expert_width_key, width)
        if adapter.config_shared_width_key is not None and record.shared_expert_width:
            size = next(iter(shared)) if stock and shared else record.shared_expert_width
            setattr(model.config, adapter.config_shared_width_key, size)

    def rechoose(self, adapter: HeadAdapter, layer: int, checked, removed: list[int]):
        width = len(checked[0]) + len(checked[1])
        return (removed, [c for c in range(width) if c not in set(removed)])

    def compensation_cuts(self, adapter: HeadAdapter, checked, apply, choose) -> dict[int, list]:
        return mlp_cuts(adapter, checked, apply, choose)

    def record_cut(self, record: PruningRecord, origin: list[int], checked) -> list[MlpChange]:
        changes = []
        for layer, entry in checked.items():
            removed, keep = entry[0], entry[1]
            if isinstance(entry, ExpertChannels):
                kept_original = record.kept_moe_items(origin[layer])
                if len(kept_original) != len(removed) + len(keep):
                    raise ValueError(
                        f"layer {layer}: the pruning record holds {len(kept_original)} expert channels, the model "
                        f"{len(removed) + len(keep)}"
                    )
                removed_original = [kept_original[c] for c in removed]
                record.pruned_expert_channels[origin[layer]] = sorted(
                    set(record.pruned_expert_channels.get(origin[layer], [])) | set(removed_original)
                )
                changes.append(MlpChange(layer, removed, removed_original, len(keep)))
                continue
            kept_original = record.kept_channels(origin[layer])
            removed_original = [kept_original[c] for c in removed]
            record.pruned_mlp[origin[layer]] = sorted(
                set(record.pruned_mlp.get(origin[layer], [])) | set(removed_original)
            )
            changes.append(MlpChange(layer, removed, removed_original, len(keep)))
        return changes


def _least(min_per_layer: int | None, mode: str, width: int) -> int:
    """The items a layer keeps at least under a part's settings (select_channels' default floors)."""
    if min_per_layer is not None:
        return min_per_layer
    return quarter(width) if mode == "global" else 1


def _span(values: set[int]) -> str:
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low} to {high}"


@dataclass
class MlpChange:
    """What happened to one layer's MLP channels: numbering before this call and the original one."""

    layer: int
    removed: list[int]
    removed_original: list[int]
    kept: int


def channel_cost(model: nn.Module, layer: int) -> int:
    """Parameters one MLP channel of ``layer`` holds: its rows (and biases) in gate / up, its down column."""
    adapter = get_adapter(model)
    width = adapter.intermediate_size(layer)
    rows = sum(p.numel() for m in adapter.mlp_in(layer) for p in m.parameters())
    out = adapter.mlp_out(layer).weight.numel()
    return (rows + out) // width if width else 0


def plan_channels(adapter: HeadAdapter, mlp: Mapping[int, Iterable[int]]) -> dict[int, tuple[list[int], list[int]]]:
    """Validate the ``"mlp"`` part of a plan; per layer: (removed, kept channels), current numbering."""
    if not isinstance(mlp, Mapping):
        raise ValueError(f"plan['mlp'] must map layer index -> channel indices, got {type(mlp).__name__}")
    out = {}
    for layer, removed in per_layer(adapter, mlp, "mlp ", "channel"):
        geometry = moe_geometry(adapter, layer)
        if geometry is not None:
            if removed:
                out[layer] = plan_expert_channels(layer, geometry, removed)
            continue
        width = adapter.intermediate_size(layer)
        bad = [c for c in removed if not 0 <= c < width]
        if bad:
            raise ValueError(f"mlp layer {layer}: channel indices {bad} out of range 0..{width - 1}")
        if not removed:
            continue
        if len(removed) == width:
            raise ValueError(f"mlp layer {layer}: removing all {width} channels is refused; remove the layer instead")
        gone = set(removed)
        out[layer] = (sorted(removed), [c for c in range(width) if c not in gone])
    return out


# -- channels inside experts ----------------------------------------------------------------------

#: A cut expert keeps a multiple of this many channels: transformers' ``grouped_mm`` experts kernel (the
#: default forward of fused experts) needs 16-byte aligned rows, 8 channels in 16-bit weights.
EXPERT_ALIGN = 8


class Geometry(NamedTuple):
    """A mixture-of-experts layer's routed experts, their width and the shared expert's width (0: none)."""

    experts: int
    width: int
    shared: int

    @property
    def total(self) -> int:
        return self.experts * self.width + self.shared


class ExpertChannels(NamedTuple):
    """A MoE layer's checked plan entry: removed and kept items (current numbering), and its geometry."""

    removed: list[int]
    kept: list[int]
    geometry: Geometry

    def split(self) -> tuple[list[list[int]], list[int]]:
        """The kept channels per routed expert and the shared expert's kept channels."""
        g = self.geometry
        routed: list[list[int]] = [[] for _ in range(g.experts)]
        shared = []
        for item in self.kept:
            if item < g.experts * g.width:
                routed[item // g.width].append(item % g.width)
            else:
                shared.append(item - g.experts * g.width)
        return routed, shared


def moe_geometry(adapter: HeadAdapter, layer: int) -> Geometry | None:
    """The geometry of a mixture-of-experts layer, None for a dense one."""
    count = adapter.num_experts(layer)
    if not count:
        return None
    return Geometry(count, adapter.expert_width(layer), adapter.shared_width(layer))


def layer_width(adapter: HeadAdapter, layer: int) -> int:
    """How many MLP items ``layer`` holds: its dense width, or every channel inside its experts."""
    geometry = moe_geometry(adapter, layer)
    return adapter.intermediate_size(layer) if geometry is None else geometry.total


def plan_expert_channels(layer: int, g: Geometry, removed: list[int]) -> ExpertChannels:
    """A MoE layer's plan entry checked: items in range, the same count from every routed expert, every
    expert and the shared one keeping at least one channel (one-line ``ValueError`` otherwise)."""
    bad = [c for c in removed if not 0 <= c < g.total]
    if bad:
        raise ValueError(
            f"mlp layer {layer}: channel indices {bad} out of range 0..{g.total - 1} ({g.experts} experts of "
            f"{g.width} channels" + (f", then {g.shared} shared-expert channels)" if g.shared else ")")
        )
    counts = [0] * g.experts
    shared = 0
    for item in removed:
        if item < g.experts * g.width:
            counts[item // g.width] += 1
        else:
            shared += 1
    if len(set(counts)) > 1:
        raise ValueError(
            f"mlp layer {layer}: every expert must lose the same number of channels (the fused expert weights "
            f"hold one width); per-expert counts {counts}"
        )
    if counts[0] == g.width:
        raise ValueError(
            f"mlp layer {layer}: removing all {g.width} channels of every expert is refused; remove the layer instead"
        )
    if counts[0] and (g.width - counts[0]) % EXPERT_ALIGN:
        raise ValueError(
            f"mlp layer {layer}: the experts would keep {g.width - counts[0]} channels; a cut expert keeps a multiple "
            f"of {EXPERT_ALIGN} (transformers' grouped_mm expert kernel needs 16-byte aligned rows)"
        )
    if g.shared and shared == g.shared:
        raise ValueError(f"mlp layer {layer}: removing all {g.shared} channels of the shared expert is refused")
    gone = set(removed)
    return ExpertChannels(sorted(removed), [c for c in range(g.total) if c not in gone], g)


def moe_items(record, g: Geometry, orig: int) -> list[int]:
    """The items a MoE layer (original ``orig``) still holds, in original numbering."""
    if record is None or record.num_experts is None:
        return list(range(g.total))
    if record.expert_width is None:  # no channel inside an expert cut yet: the widths are the original ones
        base = record.num_experts * g.width
        return [e * g.width + c for e in record.kept_experts(orig) for c in range(g.width)] + [
            base + c for c in range(g.shared)
        ]
    return record.kept_moe_items(orig)


def expert_steps(g: Geometry, multiple: int = 1) -> list[tuple[int, int]]:
    """The cuts a MoE layer can take, ascending: ``(k, s)``, each routed expert losing ``k`` channels (keeping a
    multiple of ``multiple`` and of :data:`EXPERT_ALIGN`) and the shared expert the same fraction
    ``s = k * shared // width`` (keeping at least one)."""
    step = math.lcm(multiple, EXPERT_ALIGN)
    ks = [0] + [k for k in range(1, g.width) if (g.width - k) % step == 0]
    return [(k, min(k * g.shared // g.width, g.shared - 1) if g.shared else 0) for k in ks]


def _lowest(scores: list[float], count: int, tie_seed: int) -> list[int]:
    tie = list(range(len(scores)))
    random.Random(tie_seed).shuffle(tie)
    return sorted(sorted(range(len(scores)), key=lambda j: (scores[j], tie[j]))[:count])


def within_experts(adapter: HeadAdapter, chosen: dict[int, list[int]], rows, layers: list[int], floors,
                   multiple: int, seed: int, exact: bool) -> dict[int, list[int]]:  # fmt: skip
    """``chosen`` (the generic per-layer selection among ``layers``) with every MoE layer's count made one its
    experts can take (:func:`expert_steps`): the largest not above it, then, while the total falls short of
    the chosen total, one step more for the MoE layer furthest below its count whose step still fits (and
    keeps ``floors[layer]`` items). Each routed expert loses its own lowest-scored channels, the shared
    expert its share."""
    wanted = {layer: len(items) for layer, items in chosen.items()}
    target = sum(wanted.values())
    moe = {layer: g for layer in layers if (g := moe_geometry(adapter, layer)) is not None}
    if not moe:
        return chosen
    steps = {layer: expert_steps(g, multiple) for layer, g in moe.items()}
    removed = {layer: lambda i, layer=layer: moe[layer].experts * steps[layer][i][0] + steps[layer][i][1]
               for layer in moe}  # fmt: skip
    at = {layer: max(i for i in range(len(steps[layer])) if removed[layer](i) <= wanted.get(layer, 0)) for layer in moe}
    got = sum(n for layer, n in wanted.items() if layer not in moe) + sum(removed[m](i) for m, i in at.items())
    while got < target:
        fits = [
            (wanted.get(m, 0) - removed[m](i), -m)
            for m, i in at.items()
            if i + 1 < len(steps[m])
            and got + removed[m](i + 1) - removed[m](i) <= target
            and moe[m].total - removed[m](i + 1) >= floors[m]
        ]
        if not fits:
            break
        layer = -max(fits)[1]
        got += removed[layer](at[layer] + 1) - removed[layer](at[layer])
        at[layer] += 1
    out = {layer: items for layer, items in chosen.items() if layer not in moe}
    for layer, i in at.items():
        g, (k, s), row = moe[layer], steps[layer][i], rows[layer]
        if not k and not s:
            continue
        base = g.experts * g.width
        out[layer] = [e * g.width + c for e in range(g.experts)
                      for c in _lowest(row[e * g.width : (e + 1) * g.width], k, seed + layer)]  # fmt: skip
        out[layer] += [base + c for c in _lowest(row[base:], s, seed + layer)]
    if got < target and exact:
        raise ValueError(
            f"cannot remove exactly {target} MLP channels: every expert of a mixture-of-experts layer loses the "
            f"same number (a kept width a multiple of {EXPERT_ALIGN}), so the nearest achievable below is {got}"
        )
    if got < target:
        logging.getLogger(__name__).warning(
            "sinv_prune: %d MLP channels requested, %d removed: every expert of a mixture-of-experts layer loses "
            "the same number",
            target,
            got,
        )
    return dict(sorted(out.items()))


def rebuild_experts(adapter: HeadAdapter, layer: int, orig: int, record: PruningRecord) -> None:
    """Slice a freshly built MoE layer's experts to the record's channels. Runs before the experts unit's
    rebuild: experts the record removed are still there and keep any channels of the kept ones' count."""
    kept_experts = record.kept_experts(orig)
    present = kept_experts if adapter.num_experts(layer) == len(kept_experts) else range(record.num_experts)
    keep = {e: record.kept_expert_channels(orig, e) for e in kept_experts}
    count = len(next(iter(keep.values())))
    routed = [keep.get(e, list(range(count))) for e in present]
    shared = record.kept_shared_channels(orig) if record.shared_expert_width else []
    apply_expert_channels(adapter, layer, routed, shared)


MLP = register_unit(MlpUnit())
