"""Experts: the routed experts of each mixture-of-experts layer (dense layers hold none).

Removing experts is exact in this sense: the pruned model computes what the original computes when its
routers give the removed experts' logits ``-inf`` (never chosen; the softmax and any top-k renormalisation
then run over the kept experts, which is what the sliced router computes). A layer keeps at least
``num_experts_per_tok`` experts (the router's top-k needs them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.surgery.record import PruningRecord
from sinv_prune.surgery.unit import Unit, per_layer, register_unit, score_rows
from sinv_prune.units.experts.gates import expert_gates
from sinv_prune.units.mlp.selection import removal_counts, select_channels

logger = logging.getLogger(__name__)


class ExpertsUnit(Unit):
    """Routed experts, ``{layer: [experts]}``; a MoE layer keeps at least ``num_experts_per_tok`` (or the part's
    ``min_per_layer``, if larger); same count in every MoE layer (``mode: uniform``, the default) keeps the
    checkpoint loadable by the stock class, vLLM and llama.cpp."""

    name = "experts"
    noun = "expert"
    plural = "experts"
    default_mode = "uniform"
    recipe_keys = {"min_experts_per_layer": "min_per_layer"}
    summary_field = "experts"
    described = "experts"
    record_field = "pruned_experts"
    card_label = "Experts"

    def sizes(self, model: nn.Module) -> list[int]:
        adapter = get_adapter(model)
        return [adapter.num_experts(layer) for layer in range(adapter.num_layers)]

    def cost(self, model: nn.Module, layer: int) -> int:
        """One expert's weights (and biases) plus its router row."""
        adapter = get_adapter(model)
        count = adapter.num_experts(layer)
        if not count:
            return 0
        modules = (adapter.experts(layer), adapter.router(layer))
        return sum(p.numel() for m in modules for p in m.parameters(recurse=False) if p.shape[0] == count) // count

    def gates(self, model: nn.Module, *, requires_grad: bool = True):
        return expert_gates(model, requires_grad=requires_grad)

    def allowed(self, model, layer, row, min_per_layer, multiple, shape):
        adapter = get_adapter(model)
        count = adapter.num_experts(layer)
        if len(row) != count:
            raise ValueError(f"layer {layer}: {len(row)} scores for {count} experts")
        return (removal_counts(count, self._floor(adapter, min_per_layer), 1) if count else [0]), None

    def select(self, model, part, scores, amount, kept, exact):
        adapter = get_adapter(model)
        sizes = self.sizes(model)
        rows = score_rows(scores, len(sizes), self.name)
        moe = [layer for layer in kept if sizes[layer]]
        if not moe:
            raise ValueError("the model has no mixture-of-experts layers: there are no experts to remove")
        chosen = select_channels(
            [sizes[layer] for layer in moe],
            [rows[layer] for layer in moe],
            amount,
            mode=part.mode,
            min_channels_per_layer=self._floor(adapter, part.min_per_layer),
            seed=part.seed,
            exact=exact,
            items="experts",
        )
        return {moe[i]: experts for i, experts in chosen.items()}

    def check_amount(self, adapter, amount, options) -> None:
        counts = adapter.expert_counts()
        if not counts:
            kind = adapter.model.config.model_type
            raise ValueError(f"{kind} has no mixture-of-experts layers: there are no experts to remove")
        keep = self._floor(adapter, options.get("min_per_layer"))
        most = sum(counts) - keep * len(counts)
        # a fraction is of every expert, rounded half up, as the selection counts it
        wanted = math.floor(amount * sum(counts) + 0.5) if isinstance(amount, float) else amount
        if isinstance(wanted, int) and wanted > most:
            asked = f"{amount:g} of the experts ({wanted})" if isinstance(amount, float) else f"{amount} experts"
            raise ValueError(
                f"{asked} requested, at most {most} can go ({sum(counts)} in {len(counts)} MoE layers, "
                f"{keep} kept per layer: num_experts_per_tok or min_experts_per_layer)"
            )

    @staticmethod
    def _floor(adapter: HeadAdapter, min_per_layer: int | None) -> int:
        top_k = adapter.top_k() if hasattr(adapter, "top_k") else 1
        return max(top_k, min_per_layer or 0)

    # -- geometry in original numbering -------------------------------------------------------

    def original_items(self, record, adapter, layer, orig):
        if record is None or record.num_experts is None:
            return list(range(adapter.num_experts(layer)))
        return record.kept_experts(orig) if adapter.num_experts(layer) else []

    def change(self, adapter, layer, where, gone, now, kept):
        return ExpertChange(layer, where, gone, len(kept))

    # -- the plan -------------------------------------------------------------------------------

    def validate(self, model, adapter, entry, *, allow_empty_layers=False):
        return plan_experts(adapter, {} if entry is None else entry)

    def touched(self, adapter: HeadAdapter, layer: int) -> list[nn.Module]:
        return adapter.expert_modules(layer)

    def cut(self, adapter: HeadAdapter, layer: int, checked) -> None:
        apply_experts(adapter, layer, checked[1])

    def check_compensation(self, model, adapter, checked, compensate) -> None:
        if compensate is not None:
            raise ValueError(
                f"compensate={compensate!r} refits the consumer of removed columns; removed experts have none "
                "(the router renormalises over the kept ones): prune experts with compensate=None"
            )

    def record_cut(self, record: PruningRecord, origin: list[int], checked) -> list:
        changes = []
        for layer, (removed, keep) in checked.items():
            kept_original = record.kept_experts(origin[layer])
            removed_original = [kept_original[e] for e in removed]
            record.pruned_experts[origin[layer]] = sorted(
                set(record.pruned_experts.get(origin[layer], [])) | set(removed_original)
            )
            changes.append(ExpertChange(layer, removed, removed_original, len(keep)))
        return changes

    def rebuild(self, adapter: HeadAdapter, layer: int, orig: int, record: PruningRecord) -> None:
        """Slice a freshly built layer to the record's experts; one the config already built at the kept count
        (one count in every MoE layer, which the config states) stays as it is."""
        if not record.pruned_experts.get(orig):
            return
        kept, count = record.kept_experts(orig), adapter.num_experts(layer)
        if count == len(kept):
            return
        if count != record.num_experts:
            raise ValueError(
                f"layer {layer}: the config builds {count} experts, the pruning record keeps {len(kept)} of "
                f"{record.num_experts}"
            )
        apply_experts(adapter, layer, kept)

    # -- reload routes ------------------------------------------------------------------------------

    def stock_refusal(self, adapter: HeadAdapter, record: PruningRecord) -> str | None:
        counts = adapter.expert_counts()
        if record.pruned_experts and len(set(counts)) > 1:
            return (
                "MoE layers keep different expert counts, which stock classes (and vLLM and llama.cpp, which read "
                "one count) cannot describe"
            )
        return None

    def state_config(self, model: nn.Module, adapter: HeadAdapter, record: PruningRecord, stock: bool) -> None:
        """Set the config's expert count and the load-balancing loss's to match the layers.

        One count in every MoE layer: the config and ``*ForCausalLM.num_experts`` (what transformers'
        load-balancing loss sizes its per-expert sums with) state it, on either route (the remote-code
        rebuild then leaves the built layers as they are). Different counts: the config keeps the original
        (the rebuild slices each layer from it) and the loss runs over the layers' router logits padded
        with never-chosen experts (logit ``-inf``) to the largest count, ``num_experts`` that count
        (:func:`pad_router_logits`): transformers' formula as it stands, which a uniform cut gives unchanged."""
        if adapter.config_experts_key is None or record.num_experts is None:
            return
        counts = adapter.expert_counts()
        uneven = len(set(counts)) > 1
        count = counts[0] if counts and not uneven else record.num_experts
        setattr(model.config, adapter.config_experts_key, count)
        if isinstance(getattr(model, "num_experts", None), int):  # *ForCausalLM's load-balancing loss reads it
            model.num_experts = max(counts) if uneven else count
        _pad_router_logits_when(adapter.base, uneven)
        if counts or not getattr(model.config, "output_router_logits", False):
            return
        # with no router logits at all, transformers' load-balancing loss indexes an empty tuple
        model.config.output_router_logits = False
        logger.warning("sinv_prune: no mixture-of-experts layer is left, so there is no load-balancing loss to "
                       "compute; output_router_logits is off, so fine-tuning trains without it")  # fmt: skip

    # -- words ------------------------------------------------------------------------------------

    def info(self, record, layer):
        if record.num_experts is None or not record.pruned_experts:
            return ""
        removed = record.pruned_experts.get(layer, [])
        return f"  experts kept {record.num_experts - len(removed)}/{record.num_experts} removed {removed}"

    def applies(self, record) -> bool:
        return record.num_experts is not None

    def card_text(self, record):
        if not record.pruned_experts:
            return ""
        kept = sorted({len(record.kept_experts(i)) for i in record.pruned_experts})
        count = f"{kept[0]}" if len(kept) == 1 else f"{kept[0]} to {kept[-1]}"
        return f"{count} of {record.num_experts} experts kept in the pruned MoE layers"


@dataclass
class ExpertChange:
    """What happened to one layer's experts: numbering before this call and the original one."""

    layer: int
    removed: list[int]
    removed_original: list[int]
    kept: int


def pad_router_logits(module: nn.Module, args, output):
    """A forward hook on a MoE model's base model: each layer's router logits in ``output.router_logits``
    padded with ``-inf`` columns to the widest layer's count, so transformers' load-balancing loss (one
    expert count for every layer) takes layers that keep different counts; a padded expert has probability
    0 and is never in a top k. The MoE blocks route from the routers' own outputs, which stay as they are."""
    logits = getattr(output, "router_logits", None)
    if logits:
        width = max(t.shape[-1] for t in logits)
        output.router_logits = tuple(
            nn.functional.pad(t, (0, width - t.shape[-1]), value=float("-inf")) for t in logits
        )
    return output


def _pad_router_logits_when(base: nn.Module, on: bool) -> None:
    """Register :func:`pad_router_logits` on ``base`` once (``on``), or take it off."""
    present = [key for key, hook in base._forward_hooks.items() if hook is pad_router_logits]
    if on and not present:
        base.register_forward_hook(pad_router_logits)
    elif not on:
        for key in present:
            del base._forward_hooks[key]


def apply_experts(adapter: HeadAdapter, layer: int, keep: list[int]) -> None:
    """Slice one MoE layer to the experts ``keep`` (current numbering, ascending)."""
    device = adapter.router(layer).weight.device
    adapter.slice_experts(layer, torch.tensor(keep, dtype=torch.long, device=device))


def plan_experts(adapter: HeadAdapter, request) -> dict[int, tuple[list[int], list[int]]]:
    """Validate the ``"experts"`` part of a plan; per layer: (removed, kept experts), current numbering."""
    from collections.abc import Mapping

    if not isinstance(request, Mapping):
        raise ValueError(f"plan['experts'] must map layer index -> expert indices, got {type(request).__name__}")
    out = {}
    for layer, removed in per_layer(adapter, request, "experts ", "expert"):
        count = adapter.num_experts(layer)
        if not count:
            if removed:
                raise ValueError(f"experts layer {layer}: a dense layer (no experts); the MoE layers are "
                                 f"{[i for i in range(adapter.num_layers) if adapter.num_experts(i)]}")  # fmt: skip
            continue
        bad = [e for e in removed if not 0 <= e < count]
        if bad:
            raise ValueError(f"experts layer {layer}: expert indices {bad} out of range 0..{count - 1}")
        if not removed:
            continue
        top_k = adapter.top_k()
        if count - len(removed) < top_k:
            raise ValueError(
                f"experts layer {layer}: removing {len(removed)} of {count} experts leaves {count - len(removed)}, "
                f"fewer than num_experts_per_tok={top_k} (the router picks that many per token)"
            )
        gone = set(removed)
        out[layer] = (sorted(removed), [e for e in range(count) if e not in gone])
    return out


EXPERTS = register_unit(ExpertsUnit())
