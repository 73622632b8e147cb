"""Compensation at prune time: re-fit what remains so each block keeps the unpruned block's output.

:func:`~sinv_prune.prune` calls this with ``calibration`` batches and ``compensate``:

* ``"lsq"``: sequential least squares, block by block. Two hidden-state streams run over the
  calibration tokens: the unpruned *teacher* and the pruned (and already compensated) *student*.
  For each block that loses units, the teacher block gives the consumer's target output ``Y``;
  the block is then sliced, the student's kept consumer inputs ``X`` are collected, and the
  consumer is refitted (:class:`~sinv_prune.surgery.refit.ConsumerFit`) so ``[X 1][W b]^T`` reproduces
  ``Y``. Each block is thus fitted on the inputs it will really see.
* ``"obs"``: as ``lsq``, but which units go inside each layer (as many as the plan says, per KV
  group for heads under GQA; which whole KV groups, where the plan empties whole groups only) is
  chosen first by greedy OBS on the student's inputs (:func:`~sinv_prune.surgery.obs.obs_select`);
  the plan and the record follow that choice.
* ``target="residual"`` (with ``lsq`` / ``obs``): the consumer reproduces the teacher's residual stream after
  it, not its own output: ``Y`` is the teacher's consumer output plus the teacher's residual stream less
  the student's (the input of the pre-norm the output is added to, the cut's ``residual``:
  :meth:`~sinv_prune.arch.base.HeadAdapter.attention_residual_norm` / ``mlp_residual_norm``), so the refit
  also cancels what the blocks before it got wrong. ``"output"`` (default) fits each consumer to its own
  unpruned output, blind to the error already in the stream.
* ``"bias"`` (FLAP): the removed units' mean contribution on the unpruned model,
  ``W[:, removed] @ mean(X_removed)``, is added to the consumer's bias.

**The guard**: a share of the calibration sequences is held out
(:func:`~sinv_prune.surgery.block_inputs.mark_heldout`). Each consumer is fitted on the rest, with
each ridge of :data:`RIDGES` (or the one given), and keeps the candidate with the lowest error on
the held-out tokens, the plainly pruned weights included, so a refit that does not generalise is
dropped. After the last block the held-out loss of the compensated model is compared with that of
the plainly pruned one (every refit undone) and the better model is kept; the report says which.

Every block's own inputs are caught first (:mod:`~sinv_prune.surgery.block_inputs`), so models
mixing sliding-window and full attention layers work. A :class:`Cut` names one consumer and the
columns it keeps, so MLP channels (the down projection) go through the same code as heads. Alive
at once: the two streams and one consumer's targets (each tokens x hidden width, in the model's
dtype) and one consumer's statistics twice (fit and held-out, float64, width^2; products in
``precision``). The plainly pruned weights of every refitted consumer (to undo the refits) wait in
a :class:`~sinv_prune.surgery.store.Store`: host memory, or files with ``store="disk"``, so that the
memory beyond the model does not grow with depth; at the end the fitted and plain weights are
swapped through it one consumer at a time.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.arch.base import linear_weight
from sinv_prune.surgery.block_inputs import HOLDOUT, BlockInput, Stop, capture_block_inputs, preserve_modes, rows
from sinv_prune.surgery.cuts import Cut
from sinv_prune.surgery.heldout import HeldOutLoss
from sinv_prune.surgery.obs import obs_select
from sinv_prune.surgery.offload import Turns, onloaded
from sinv_prune.surgery.refit import ConsumerFit, consumer_weights, write_consumer
from sinv_prune.surgery.store import Store

__all__ = ["METHODS", "RIDGES", "CompensationReport", "Cut", "LayerFit", "capture_block_inputs", "default_ridge"]

METHODS = ("bias", "lsq", "obs")
PRECISIONS = {"float32": torch.float32, "float64": torch.float64}
#: What a refitted consumer reproduces: the unpruned consumer's output, or the unpruned residual stream after it.
TARGETS = ("output", "residual")
#: Relative ridges a consumer may take when none is given; the held-out tokens pick one (or none) by a walk.
RIDGES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def default_ridge(tokens: int) -> float:
    """Relative ridge for ``tokens`` calibration tokens when none can be picked on held-out tokens.

    0.1 at 8,192 tokens and about 1 at 1,024 (scripts/time_compensation.py on SmolLM2 found these
    best at those counts), log-linear between and beyond, within [0.01, 10].
    """
    return float(min(10.0, max(0.01, 0.1 * (8192 / max(tokens, 1)) ** (math.log(10) / math.log(8)))))


@dataclass
class LayerFit:
    """One refitted consumer: relative error of its output against the unpruned one, before and after.

    Errors are ``|output - unpruned output| / |unpruned output|`` on the inputs the compensated
    model gives the consumer: ``error_*`` over every calibration token, ``heldout_*`` over the
    held-out ones (None without); ``before`` is plain pruning. ``ridge`` is the chosen relative
    ridge, None where the plainly pruned weights were kept (``refit`` False).
    """

    layer: int
    unit: str
    kept_columns: int
    error_before: float
    error_after: float
    seconds: float
    heldout_before: float | None = None
    heldout_after: float | None = None
    ridge: float | None = None
    refit: bool = True


@dataclass
class CompensationReport:
    """What compensation did: method, data seen, time, per refitted consumer a :class:`LayerFit`, the model kept.

    ``heldout_loss`` holds the held-out loss (``heldout_kind``) of the ``unpruned``, ``plain`` and
    ``compensated`` models; ``kept`` is ``"compensated"`` or ``"plain"`` (the lower held-out loss),
    or ``"compensated"`` without held-out tokens.
    """

    method: str
    ridge: float | str
    batches: int
    tokens: int
    seconds: float = 0.0
    bias_added: bool = False
    layers: list[LayerFit] = field(default_factory=list)
    heldout_tokens: int = 0
    heldout_kind: str | None = None
    heldout_loss: dict[str, float] = field(default_factory=dict)
    kept: str = "compensated"
    precision: str = "float32"
    target: str = "output"

    def to_dict(self) -> dict:
        return {**asdict(self), "us_per_token": self.us_per_token}

    @property
    def us_per_token(self) -> float:
        """Compensation time per calibration token, in microseconds."""
        return 1e6 * self.seconds / max(self.tokens, 1)

    def headline(self) -> str:
        line = (
            f"compensation {self.method}: {self.batches} batches, {self.tokens} tokens "
            f"({self.heldout_tokens} held out), {self.seconds:.1f} s ({self.us_per_token:.0f} us/token)"
        )
        refits = sum(f.refit for f in self.layers)
        line += f", {refits}/{len(self.layers)} consumers refitted"
        if self.heldout_loss:
            loss = self.heldout_loss
            line += (
                f"; held-out {self.heldout_kind}: unpruned {loss['unpruned']:.4f}, plain {loss['plain']:.4f}, "
                f"compensated {loss['compensated']:.4f}"
            )
        return line + f"; kept the {self.kept} model"

    def __str__(self) -> str:
        rows_ = [
            f"  layer {f.layer:>3} {f.unit}: error {f.error_before:.4f} -> {f.error_after:.4f}"
            + (f", held out {f.heldout_before:.4f} -> {f.heldout_after:.4f}" if f.heldout_before is not None else "")
            + (f", ridge {f.ridge:g}" if f.refit else ", kept plain")
            for f in self.layers
        ]
        return "\n".join([self.headline(), *rows_])


# -- validation -------------------------------------------------------------------------------


def check_options(
    model: nn.Module,
    adapter: HeadAdapter,
    method: str | None,
    calibration,
    ridge: float | None,
    add_bias: bool,
    precision: str = "float32",
    holdout: float = HOLDOUT,
    target: str = "output",
) -> None:
    """Refuse bad compensation arguments with one ``ValueError``, before anything changes."""
    if target not in TARGETS:
        raise ValueError(f"unknown compensation target {target!r}: choose one of {', '.join(TARGETS)}")
    if target == "residual" and method not in ("lsq", "obs"):
        raise ValueError(f"target='residual' needs compensate='lsq' or 'obs' (a least-squares refit), got {method!r}")
    if target == "residual" and not adapter.residual_norms():
        raise ValueError(f"target='residual' needs pre-norm blocks (the LLaMA layout); {model.config.model_type} "
                         "has none: use target='output'")  # fmt: skip
    if method is None:
        if calibration is not None or add_bias:
            used = "calibration batches are" if calibration is not None else "add_bias is"
            raise ValueError(f"{used} only used with compensate='lsq', 'obs' or 'bias'")
        return
    if method not in METHODS:
        raise ValueError(f"unknown compensation {method!r}: choose one of {', '.join(METHODS)} or None")
    if calibration is None:
        raise ValueError(f"compensate={method!r} needs calibration batches (dicts with input_ids)")
    if isinstance(calibration, (Mapping, str, bytes, torch.Tensor)) or not isinstance(calibration, Iterable):
        raise ValueError(f"calibration must be an iterable of batches (dicts), got {type(calibration).__name__}")
    if ridge is not None and (
        isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0
    ):
        raise ValueError(f"ridge must be a finite number >= 0 or None (picked on held-out tokens), got {ridge!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout <= 0.5:
        raise ValueError(f"holdout must be a share between 0 and 0.5 of the calibration sequences, got {holdout!r}")
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
    blocks = adapter.layers()
    with Turns() as turn:
        for layer in range(adapter.num_layers):
            turn(blocks[layer])  # offloaded blocks: the new biases go to the weights map
            attn = adapter.attention(layer)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                proj = getattr(attn, name)
                if proj.bias is None:
                    proj.bias = nn.Parameter(
                        proj.weight.new_zeros(proj.out_features), requires_grad=proj.weight.requires_grad
                    )
    model.config.attention_bias = True
    return True


# -- the sequential refit ---------------------------------------------------------------------


@dataclass
class _Undo:
    """A refitted consumer and the key of its plainly pruned weights in the store."""

    consumer: nn.Module
    key: tuple


def compensate(
    model: nn.Module,
    adapter: HeadAdapter,
    cuts: Mapping[int, list[Cut]],
    inputs: list[BlockInput],
    method: str,
    ridge: float | None,
    precision: str = "float32",
    store: Store | None = None,
    after_block: Callable[[], None] | None = None,
    target: str = "output",
    progress: bool = False,
) -> CompensationReport:
    """Apply every cut block by block, refitting each consumer on the student stream (see the module doc).

    ``store`` keeps the plainly pruned weights of the refitted consumers (default: a host store of
    its own); ``after_block()`` is called once each block is cut and refitted (prune's rollback
    moves that block's old weights into its store then); ``progress``: a bar over the blocks.
    """
    from sinv_prune.progress import bar

    if store is None:
        with Store("cpu") as own:
            return compensate(model, adapter, cuts, inputs, method, ridge, precision, own, after_block, target,
                              progress)  # fmt: skip
    start = time.perf_counter()
    tokens = sum(i.tokens for i in inputs)
    held = sum(int(i.heldout.sum()) for i in inputs if i.heldout is not None)
    report = CompensationReport(method, "auto" if ridge is None else float(ridge), len(inputs), int(tokens))
    report.heldout_tokens, report.precision, report.target = held, precision, target
    if not cuts:
        return report
    heldout = HeldOutLoss(model, adapter, inputs) if held else None
    blocks, last, undo = adapter.layers(), max(cuts), []
    options = _Options(method, ridge, PRECISIONS[precision], held > 0)
    teacher, student, residual = [i.hidden for i in inputs], None, target == "residual"
    with torch.no_grad(), Turns() as turn:
        for index in bar(range(last + 1), desc=f"{method} compensation", unit="block", disable=not progress):
            block, layer_cuts = blocks[index], cuts.get(index, [])
            turn(block)  # an offloaded block's weights come in for its turn; what changed goes back after
            targets = None
            if layer_cuts:
                advance = index < last
                targets, advanced = _teacher_pass(index, block, layer_cuts, teacher, inputs, method, advance, residual)
            else:
                advanced = [i.run(block, index, h) for h, i in zip(teacher, inputs, strict=True)]
            if student is None and layer_cuts:
                student = teacher  # identical up to the first cut
            teacher = advanced
            for cut, recorded in zip(layer_cuts, targets or [], strict=False):
                fit, plain = _fit(index, block, cut, recorded, student, inputs, options)
                report.layers.append(fit)
                if plain is not None and heldout:
                    key = ("plain", index, len(undo))
                    store.put(key, {"weight": plain[0], "bias": plain[1]})
                    undo.append(_Undo(cut.consumer, key))
            if after_block is not None and layer_cuts:
                after_block()
            if student is not None and index < last:
                student = [i.run(block, index, h) for h, i in zip(student, inputs, strict=True)]
        del teacher, student
        turn.end()
        if heldout:
            report.heldout_kind = heldout.kind
            report.kept, report.heldout_loss = _keep_better(heldout, undo, store)
    report.seconds = time.perf_counter() - start
    return report


def _keep_better(heldout: HeldOutLoss, undo: list[_Undo], store: Store) -> tuple[str, dict[str, float]]:
    """Measure the compensated and the plainly pruned model on the held-out tokens; keep the better.

    Each consumer's fitted weights go into ``store`` as its plain ones come out, one at a time.
    """
    compensated = heldout()
    for u in undo:
        with onloaded(u.consumer, root=heldout.model):
            _swap(u.consumer, store, u.key, ("fitted", *u.key))
    plain = heldout() if undo else compensated
    loss = {"unpruned": heldout.unpruned, "plain": plain, "compensated": compensated}
    if compensated < plain:
        for u in undo:
            with onloaded(u.consumer, root=heldout.model):
                write_consumer(u.consumer, *_weights(store.pop(("fitted", *u.key), linear_weight(u.consumer).device)))
        return "compensated", loss
    return "plain", loss


def _swap(consumer: nn.Module, store: Store, take: tuple, keep: tuple) -> None:
    """Put the consumer's weights into ``store`` under ``keep``; give it those stored under ``take``."""
    weight, bias = consumer_weights(consumer)
    store.put(keep, {"weight": weight, "bias": bias})
    write_consumer(consumer, *_weights(store.pop(take, weight.device)))


def _weights(tensors: dict) -> tuple:
    return tensors["weight"], tensors["bias"]


@dataclass
class _Options:
    method: str
    ridge: float | None
    product_dtype: torch.dtype
    guarded: bool


@dataclass
class _Target:
    """The teacher's consumer outputs per batch (valid tokens only) and the sum of its removed inputs."""

    outputs: list[torch.Tensor] = field(default_factory=list)
    #: the pre-norm whose input is the residual stream the consumer's output is added to (None: plain targets)
    norm: nn.Module | None = None
    removed_sum: torch.Tensor | None = None
    count: int = 0


def _teacher_pass(index, block, cuts, teacher, inputs, method, advance, residual: bool):
    """Run the unpruned block on the teacher stream, recording each consumer's output (plus, with ``residual``, the
    residual stream it is added to, where the cut names its norm); the advanced stream."""
    targets = [_Target(norm=cut.residual if residual else None) for cut in cuts]
    current: list[BlockInput] = []
    bases: dict[int, torch.Tensor] = {}  # per target the teacher's residual stream at its consumer, this batch

    def base(n: int):
        def hook(module, args):
            bases[n] = rows(args[0], current[0].valid)

        return hook

    def recorder(cut: Cut, target: _Target, stop: bool, n: int):
        def hook(module, args, output):
            inp = current[0]
            out = rows(output, inp.valid)
            target.outputs.append(out + bases.pop(n) if target.norm is not None else out)
            if method == "bias":
                x = rows(args[0], inp.valid)
                if inp.heldout is not None:
                    x = x[~inp.heldout]
                target.removed_sum = _add(target.removed_sum, x.index_select(1, cut.removed).double().sum(0))
                target.count += x.shape[0]
            if stop:
                raise Stop

        return hook

    hooks = [
        cut.consumer.register_forward_hook(recorder(cut, target, not advance and n == len(cuts) - 1, n))
        for n, (cut, target) in enumerate(zip(cuts, targets, strict=True))
    ]
    hooks += [t.norm.register_forward_pre_hook(base(n)) for n, t in enumerate(targets) if t.norm is not None]
    advanced = []
    try:
        for hidden, inp in zip(teacher, inputs, strict=True):
            current[:] = [inp]
            with contextlib.suppress(Stop):  # raised in the last block: only the consumers' outputs count
                advanced.append(inp.run(block, index, hidden))
    finally:
        for h in hooks:
            h.remove()
    return targets, advanced if advance else None


def _add(total, value):
    return value if total is None else total + value


def _fit(index, block, cut: Cut, target: _Target, student, inputs, options: _Options) -> tuple[LayerFit, tuple | None]:
    """Slice the block (choosing its units first for OBS), refit the consumer, keep what the held-out tokens prefer.

    Returns the fit's report and, where the consumer was refitted, its plainly pruned ``(weight, bias)``."""
    start = time.perf_counter()
    weight, bias = consumer_weights(cut.consumer)
    obs = options.method == "obs"
    if not obs:
        cut.apply()
    fit, held = _statistics(index, block, cut, target, student, inputs, options.product_dtype, bias is not None)
    if obs:
        cut.reselect(obs_select(fit.gram[: cut.consumer_width, : cut.consumer_width], weight, cut.width, cut.quotas))
        fit, held = fit.restrict(cut.kept), held.restrict(cut.kept)
        cut.apply()
    kept_weight = weight.index_select(1, cut.kept)
    plain = (kept_weight, bias)
    ridge, chosen, held_before, held_after = _choose(fit, held, cut, target, weight, plain, options)
    write_consumer(cut.consumer, *chosen)
    refit = chosen is not plain
    both = fit + held
    layer_fit = LayerFit(
        index, cut.unit, cut.kept.numel(), both.relative_error(*plain), both.relative_error(*chosen),
        time.perf_counter() - start, held_before, held_after, ridge if refit else None, refit,
    )  # fmt: skip
    return layer_fit, plain if refit else None


def _statistics(index, block, cut, target, student, inputs, product_dtype, bias) -> tuple[ConsumerFit, ConsumerFit]:
    """The student's consumer inputs against the teacher's outputs: fit and held-out statistics."""
    weight = linear_weight(cut.consumer)  # its width now: every column before slicing (OBS), the kept ones after
    width, out, device = weight.shape[1], target.outputs[0].shape[1], weight.device
    fit, held = (ConsumerFit(width, out, bias=bias, device=device, product_dtype=product_dtype) for _ in range(2))
    for hidden, inp, y in zip(student, inputs, target.outputs, strict=True):
        x, base = _consumer_input(index, block, cut.consumer, hidden, inp, y.shape[0], target.norm)
        if base is not None:  # the teacher's residual stream less the student's: the consumer makes up the gap
            y = y - base
        if inp.heldout is None:
            fit.update(x, y)
        else:
            fit.update(x[~inp.heldout], y[~inp.heldout])
            held.update(x[inp.heldout], y[inp.heldout])
    target.outputs.clear()
    return fit, held


def _choose(fit: ConsumerFit, held: ConsumerFit, cut: Cut, target: _Target, weight, plain: tuple, options: _Options):
    """``(ridge, (weight, bias), held-out error of plain, of the choice)`` for one consumer (:func:`walk_ridges`)."""
    if options.method == "bias":
        mean = target.removed_sum / max(target.count, 1)
        shifted = plain[1].double() + weight.index_select(1, cut.removed).double() @ mean
        solve = lambda r: (plain[0], shifted)  # noqa: E731
        ridges: tuple[float, ...] = (0.0,)
    else:
        solve = lambda r: fit.solve(*plain, r)  # noqa: E731
        ridges = (options.ridge,) if options.ridge is not None else RIDGES
    return walk_ridges(solve, held if options.guarded else None, plain, fit.tokens, ridges)


def guarded_refit(fit: ConsumerFit, held: ConsumerFit | None, plain: tuple, ridge: float | None = None):
    """The least-squares refit of one consumer from its statistics, guarded by the held-out ones.

    ``plain`` is the plainly pruned ``(weight, bias)`` over the kept columns. Returns ``(ridge, (weight,
    bias), held-out error of plain, of the choice)``; ridge None where ``plain`` is kept (see :func:`walk_ridges`).
    """
    ridges = (ridge,) if ridge is not None else RIDGES
    return walk_ridges(lambda r: fit.solve(*plain, r), held, plain, fit.tokens, ridges)


def walk_ridges(solve, held: ConsumerFit | None, plain: tuple, tokens: int, ridges: tuple[float, ...]):
    """``(ridge, (weight, bias), held-out error of plain, of the choice)``: the refit ``solve(ridge)``, or
    ``plain`` where the held-out statistics ``held`` prefer it. Without ``held``: the refit at the one ridge
    given, else at :func:`default_ridge`.

    Several ridges are walked from the one nearest :func:`default_ridge` towards lower held-out error until
    it rises (usually 3-4 solves, not 6).
    """
    if held is None:
        r = ridges[0] if len(ridges) == 1 else default_ridge(tokens)
        return r, solve(r), None, None
    scored: dict[int, tuple[float, tuple]] = {}

    def score(i: int) -> float:
        if i not in scored:
            candidate = solve(ridges[i])
            scored[i] = (held.relative_error(*candidate), candidate)
        return scored[i][0]

    target_ridge = math.log(default_ridge(tokens))
    i = min(range(len(ridges)), key=lambda j: abs(math.log(max(ridges[j], 1e-30)) - target_ridge))
    while True:
        best = min((j for j in (i - 1, i, i + 1) if 0 <= j < len(ridges)), key=score)
        if best == i:
            break
        i = best
    plain_error = held.relative_error(*plain)
    if scored[i][0] < plain_error:
        return ridges[i], scored[i][1], plain_error, scored[i][0]
    return None, plain, plain_error, plain_error


def _consumer_input(index, block, consumer, hidden, inp: BlockInput, count: int, norm: nn.Module | None = None):
    """``(input rows, residual rows)``: the consumer's input rows for one batch (the block stops there; zero
    columns if it is never called) and, with ``norm``, that norm's input rows (else None)."""
    seen, base = [], []

    def catch(module, args):
        seen.append(args[0])
        raise Stop

    handles = [consumer.register_forward_pre_hook(catch)]
    if norm is not None:
        handles.append(norm.register_forward_pre_hook(lambda module, args: base.append(rows(args[0], inp.valid))))
    try:
        with contextlib.suppress(Stop):
            inp.run(block, index, hidden)
    finally:
        for handle in handles:
            handle.remove()
    # GPT-2's empty attention (every head removed) returns the bias without calling c_proj.
    x = rows(seen[0], inp.valid) if seen else hidden.new_zeros(count, 0)
    return x, (base[0] if base else None)


def run_compensation(
    model: nn.Module,
    adapter: HeadAdapter,
    cuts: Mapping[int, list[Cut]],
    inputs: list[BlockInput],
    method: str,
    ridge: float | None,
    add_bias: bool,
    precision: str = "float32",
    store: Store | None = None,
    after_block: Callable[[], None] | None = None,
    target: str = "output",
    progress: bool = False,
) -> CompensationReport:
    """Add biases when asked, then :func:`compensate` in eval mode without gradients (modes restored)."""
    added = add_attention_biases(model, adapter) if add_bias else False
    with preserve_modes(model):
        report = compensate(model, adapter, cuts, inputs, method, ridge, precision, store, after_block, target,
                            progress)  # fmt: skip
    report.bias_added = added
    return report
