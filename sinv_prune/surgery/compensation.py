"""Compensation at prune time: re-fit what remains so each block keeps the unpruned block's output.

:func:`~sinv_prune.prune_heads` calls this with ``calibration`` batches and ``compensate``:

* ``"lsq"``: sequential least squares, block by block. Two hidden-state streams run over the
  calibration tokens: the unpruned *teacher* and the pruned (and already compensated) *student*.
  For each block that loses units, the teacher block gives the consumer's target output ``Y``;
  the block is then sliced, the student's kept consumer inputs ``X`` are collected, and the
  consumer is refitted (:class:`~sinv_prune.surgery.refit.ConsumerFit`) so ``[X 1][W b]^T`` reproduces
  ``Y``. Each block is thus fitted on the inputs it will really see.
* ``"bias"`` (FLAP): the removed units' mean contribution on the unpruned model,
  ``W[:, removed] @ mean(X_removed)``, is added to the consumer's bias.

The inputs of the first block are caught with a forward pre-hook that stops the model's forward
(the "Catcher" trick); the blocks then run one at a time. A :class:`Cut` names one consumer and
the columns it keeps, so MLP channels (the down projection) go through the same code as heads.
Alive at once: the two streams and one consumer's targets (each tokens x hidden width, in the
model's dtype) and one consumer's statistics (float64, width^2).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers.cache_utils import Cache

from sinv_prune.arch import HeadAdapter
from sinv_prune.arch.base import head_rows
from sinv_prune.scoring.criteria.base import preserve_modes
from sinv_prune.surgery.refit import ConsumerFit, consumer_weights, write_consumer

METHODS = ("bias", "lsq")
#: Relative ridge: of 0.01, 0.1 and 1, 0.1 gave the best SmolLM2 perplexity with 16 x 512 calibration tokens
#: (scripts/time_compensation.py); with only 512-2,048 tokens about 1 did better.
DEFAULT_RIDGE = 0.1


@dataclass
class LayerFit:
    """One refitted consumer: relative error of its output against the unpruned one, before and after.

    Errors are ``|output - unpruned output| / |unpruned output|`` over the calibration tokens,
    on the inputs the compensated model gives the consumer; ``before`` is plain pruning.
    """

    layer: int
    unit: str
    kept_columns: int
    error_before: float
    error_after: float
    seconds: float


@dataclass
class CompensationReport:
    """What compensation did: method, data seen, time, and one :class:`LayerFit` per refitted consumer."""

    method: str
    ridge: float
    batches: int
    tokens: int
    seconds: float = 0.0
    bias_added: bool = False
    layers: list[LayerFit] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        head = f"compensation {self.method}: {self.batches} batches, {self.tokens} tokens, {self.seconds:.1f} s"
        rows = [
            f"  layer {f.layer:>3} {f.unit}: error {f.error_before:.4f} -> {f.error_after:.4f}" for f in self.layers
        ]
        return "\n".join([head, *rows])


@dataclass
class Cut:
    """One consumer of a block losing input columns: ``apply()`` slices the block, ``kept`` columns stay.

    ``kept`` and ``removed`` index the unpruned consumer's input. A block's cuts are listed in
    forward order (attention output projection before the MLP down projection).
    """

    unit: str
    consumer: nn.Module
    kept: torch.Tensor
    removed: torch.Tensor
    apply: Callable[[], None]


@dataclass
class BlockInput:
    """What the model passes its first block for one batch, and which tokens count (not padding)."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict
    valid: torch.Tensor | None


class _Stop(Exception):
    """Raised by a hook to end a forward once it has what it needs."""


# -- validation and inputs --------------------------------------------------------------------


def check_options(
    model: nn.Module, adapter: HeadAdapter, method: str | None, calibration, ridge: float, add_bias: bool
) -> None:
    """Refuse bad compensation arguments with one ``ValueError``, before anything changes."""
    if method is None:
        if calibration is not None or add_bias:
            used = "calibration batches are" if calibration is not None else "add_bias is"
            raise ValueError(f"{used} only used with compensate='lsq' or 'bias'")
        return
    if method not in METHODS:
        raise ValueError(f"unknown compensation {method!r}: choose one of {', '.join(METHODS)} or None")
    if calibration is None:
        raise ValueError(f"compensate={method!r} needs calibration batches (dicts with input_ids)")
    if isinstance(calibration, (Mapping, str, bytes, torch.Tensor)) or not isinstance(calibration, Iterable):
        raise ValueError(f"calibration must be an iterable of batches (dicts), got {type(calibration).__name__}")
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge!r}")
    types = set(getattr(model.config, "layer_types", None) or ())
    if len(types) > 1:
        raise ValueError(f"compensation does not support models mixing attention layer types ({sorted(types)})")
    no_bias = [i for i in range(adapter.num_layers) if getattr(adapter.out_proj(i), "bias", None) is None]
    if no_bias and add_bias and not _can_add_bias(model, adapter):
        raise ValueError(
            f"add_bias=True: {model.config.model_type} has no config.attention_bias to give the output "
            "projection a bias that reloads"
        )
    if no_bias and method == "bias" and not add_bias:
        raise ValueError(
            f"compensate='bias' needs an output-projection bias, which {model.config.model_type} lacks "
            "(layers " + ", ".join(map(str, no_bias[:5])) + (", ..." if len(no_bias) > 5 else "") + "); "
            "pass add_bias=True to add one, or use compensate='lsq'"
        )


def _can_add_bias(model: nn.Module, adapter: HeadAdapter) -> bool:
    """LLaMA-family models whose config switches every attention bias on (LLaMA, Qwen3)."""
    return adapter.name == "llama" and hasattr(model.config, "attention_bias")


def add_attention_biases(model: nn.Module, adapter: HeadAdapter) -> bool:
    """Give every q/k/v/o projection a zero bias and set ``config.attention_bias``; True if any was added.

    The stock class builds all four biases from that flag, so the checkpoint reloads on it.
    """
    if all(getattr(adapter.out_proj(i), "bias", None) is not None for i in range(adapter.num_layers)):
        return False
    for layer in range(adapter.num_layers):
        attn = adapter.attention(layer)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj = getattr(attn, name)
            if proj.bias is None:
                proj.bias = nn.Parameter(
                    proj.weight.new_zeros(proj.out_features), requires_grad=proj.weight.requires_grad
                )
    model.config.attention_bias = True
    return True


def capture_block_inputs(model: nn.Module, adapter: HeadAdapter, calibration: Iterable) -> list[BlockInput]:
    """Run ``model`` on every batch up to its first block and keep that block's inputs (nothing changes)."""
    first = adapter.layers()[0]
    device = _input_device(model)
    extra = {"use_cache": False} if "use_cache" in _forward_params(model) else {}
    captured: list[tuple] = []

    def catch(module, args, kwargs):
        captured.append((args, kwargs))
        raise _Stop

    inputs = []
    handle = first.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with preserve_modes(model), torch.no_grad():
            for number, batch in enumerate(calibration):
                if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
                    raise ValueError(f"calibration batch {number} is not a dict with an input_ids tensor")
                feed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                feed.pop("labels", None)
                with contextlib.suppress(_Stop):
                    model(**feed, **extra)
                if len(captured) != number + 1:
                    raise ValueError(f"calibration batch {number} never reached the first transformer block")
                inputs.append(_block_input(*captured[-1], feed.get("attention_mask")))
    finally:
        handle.remove()
    if not inputs:
        raise ValueError("calibration holds no batches")
    return inputs


def _block_input(args: tuple, kwargs: dict, mask: torch.Tensor | None) -> BlockInput:
    kwargs = {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}
    if args:
        hidden, rest = args[0], tuple(None if isinstance(a, Cache) else a for a in args[1:])
    else:
        hidden, rest = kwargs.pop("hidden_states"), ()
    valid = None if mask is None else mask.reshape(-1).to(hidden.device).bool()
    return BlockInput(hidden, rest, kwargs, valid)


def _forward_params(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _input_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return weight.device if weight is not None else next(model.parameters()).device


# -- the sequential refit ---------------------------------------------------------------------


def head_cuts(adapter: HeadAdapter, plan: Mapping[int, tuple], apply: Callable[[int], None]) -> dict[int, list[Cut]]:
    """One :class:`Cut` per layer of a head plan (``layer -> (removed, keep_q, keep_kv)``); ``apply(layer)`` slices."""
    cuts = {}
    for layer, (removed, keep_q, _) in plan.items():
        consumer = adapter.out_proj(layer)
        device, head_dim = consumer.weight.device, adapter.layout(layer).head_dim
        columns = [head_rows(torch.tensor(h, dtype=torch.long, device=device), head_dim) for h in (keep_q, removed)]
        cuts[layer] = [Cut("heads", consumer, *columns, lambda layer=layer: apply(layer))]
    return cuts


def mlp_cuts(
    adapter: HeadAdapter, plan: Mapping[int, tuple[list[int], list[int]]], apply: Callable[[int], None]
) -> dict[int, list[Cut]]:
    """One :class:`Cut` of the down projection per layer of a channel plan (``layer -> (removed, kept)``)."""
    cuts = {}
    for layer, (removed, keep) in plan.items():
        consumer = adapter.mlp_out(layer)
        device = consumer.weight.device
        columns = [torch.tensor(c, dtype=torch.long, device=device) for c in (keep, removed)]
        cuts[layer] = [Cut("mlp", consumer, *columns, lambda layer=layer: apply(layer))]
    return cuts


def compensate(
    blocks: list[nn.Module], cuts: Mapping[int, list[Cut]], inputs: list[BlockInput], method: str, ridge: float
) -> CompensationReport:
    """Apply every cut block by block, refitting each consumer on the student stream (see the module doc)."""
    start = time.perf_counter()
    tokens = sum(i.valid.sum().item() if i.valid is not None else i.hidden.shape[:-1].numel() for i in inputs)
    report = CompensationReport(method, float(ridge), len(inputs), int(tokens))
    if not cuts:
        return report
    last = max(cuts)
    teacher, student = [i.hidden for i in inputs], None
    with torch.no_grad():
        for index in range(last + 1):
            block, layer_cuts = blocks[index], cuts.get(index, [])
            targets = None
            if layer_cuts:
                targets, advanced = _teacher_pass(block, layer_cuts, teacher, inputs, method, advance=index < last)
            else:
                advanced = [_run(block, h, i) for h, i in zip(teacher, inputs, strict=True)]
            if student is None and layer_cuts:
                student = teacher  # identical up to the first cut
            teacher = advanced
            for cut, target in zip(layer_cuts, targets or [], strict=False):
                report.layers.append(_fit(index, block, cut, target, student, inputs, method, ridge))
            if student is not None and index < last:
                student = [_run(block, h, i) for h, i in zip(student, inputs, strict=True)]
    report.seconds = time.perf_counter() - start
    return report


@dataclass
class _Target:
    """The teacher's consumer outputs per batch (valid tokens only) and the sum of its removed inputs."""

    outputs: list[torch.Tensor] = field(default_factory=list)
    removed_sum: torch.Tensor | None = None
    count: int = 0


def _teacher_pass(block, cuts, teacher, inputs, method, advance):
    """Run the unpruned block on the teacher stream, recording each consumer's output; the advanced stream."""
    targets = [_Target() for _ in cuts]
    current: list[BlockInput] = []

    def recorder(cut: Cut, target: _Target, stop: bool):
        def hook(module, args, output):
            valid = current[0].valid
            target.outputs.append(_rows(output, valid))
            if method == "bias":
                rows = _rows(args[0], valid)
                removed = rows.index_select(1, cut.removed).double().sum(0)
                target.removed_sum = removed if target.removed_sum is None else target.removed_sum + removed
                target.count += rows.shape[0]
            if stop:
                raise _Stop

        return hook

    hooks = [
        cut.consumer.register_forward_hook(recorder(cut, target, not advance and n == len(cuts) - 1))
        for n, (cut, target) in enumerate(zip(cuts, targets, strict=True))
    ]
    advanced = []
    try:
        for hidden, inp in zip(teacher, inputs, strict=True):
            current[:] = [inp]
            with contextlib.suppress(_Stop):  # raised in the last block: only the consumers' outputs count
                advanced.append(_run(block, hidden, inp))
    finally:
        for h in hooks:
            h.remove()
    return targets, advanced if advance else None


def _fit(layer, block, cut: Cut, target: _Target, student, inputs, method, ridge) -> LayerFit:
    """Slice the block, gather the student's kept consumer inputs, refit and write the consumer."""
    start = time.perf_counter()
    weight, bias = consumer_weights(cut.consumer)
    kept_weight = weight.index_select(1, cut.kept)
    cut.apply()
    fit = ConsumerFit(cut.kept.numel(), weight.shape[0], bias=bias is not None, device=weight.device)
    for hidden, inp, y in zip(student, inputs, target.outputs, strict=True):
        fit.update(_consumer_input(block, cut.consumer, hidden, inp, y.shape[0]), y)
    target.outputs.clear()
    if method == "lsq":
        new_weight, new_bias = fit.solve(kept_weight, bias, ridge)
    else:
        mean = target.removed_sum / max(target.count, 1)
        new_weight, new_bias = kept_weight, bias.double() + weight.index_select(1, cut.removed).double() @ mean
    write_consumer(cut.consumer, new_weight, new_bias)
    before, after = fit.relative_error(kept_weight, bias), fit.relative_error(new_weight, new_bias)
    return LayerFit(layer, cut.unit, cut.kept.numel(), before, after, time.perf_counter() - start)


def _consumer_input(block, consumer, hidden, inp: BlockInput, rows: int) -> torch.Tensor:
    """The consumer's input rows for one batch; the block stops there. Zero columns if it is never called."""
    seen = []

    def catch(module, args):
        seen.append(args[0])
        raise _Stop

    handle = consumer.register_forward_pre_hook(catch)
    try:
        with contextlib.suppress(_Stop):
            _run(block, hidden, inp)
    finally:
        handle.remove()
    # GPT-2's empty attention (every head removed) returns the bias without calling c_proj.
    return _rows(seen[0], inp.valid) if seen else hidden.new_zeros(rows, 0)


def _run(block: nn.Module, hidden: torch.Tensor, inp: BlockInput) -> torch.Tensor:
    out = block(hidden, *inp.args, **inp.kwargs)
    return out[0] if isinstance(out, tuple) else out


def _rows(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Tokens as rows ``[n, features]``, padding dropped."""
    x = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # not -1: a layer without heads has zero features
    return x if valid is None else x[valid]


def run_compensation(
    model: nn.Module,
    adapter: HeadAdapter,
    cuts: Mapping[int, list[Cut]],
    inputs: list[BlockInput],
    method: str,
    ridge: float,
    add_bias: bool,
) -> CompensationReport:
    """Add biases when asked, then :func:`compensate` in eval mode without gradients (modes restored)."""
    added = add_attention_biases(model, adapter) if add_bias else False
    with preserve_modes(model):
        report = compensate(adapter.layers(), cuts, inputs, method, ridge)
    report.bias_added = added
    return report
