"""How long a recipe will take, stage by stage, from a short measured probe (``--dry-run``).

The probe builds a stand-in of the starting model from its config alone (pretrained weights
are not read: the time of a forward pass does not depend on their values) on the run's device,
with the torch thread count in force, and times forward+backward passes at growing token counts,
an optimizer step, evaluation forwards, the S-invariant measures and (de)serialising weights.
Each stage's time then follows from the recipe: steps x batch shape, scoring batches,
evaluation windows, models saved and loaded. Pruned models are counted as large as the
original, so the estimate errs long. Nothing is written to disk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sinv_prune.pipeline.device_choice import synchronize
from sinv_prune.pipeline.estimate_row import CHARS_PER_TOKEN, Row
from sinv_prune.pipeline.recipe import Recipe, TrainSpec

# Fixed allowances, not measured by the probe (seconds): building a Trainer and its data
# loader; writing report.md and the plots.
TRAINER_START_S = 2.0
REPORT_S = 3.0
# Tokens a fast tokenizer makes per second (SmolLM2's on WikiText-2 on a busy 2-core machine:
# 25.8k tokens in 0.26 s).
TOKENIZE_TOKENS_PER_S = 100_000
# The probe's calls grow (doubling the tokens, up to the recipe's batch shape) until one takes
# PROBE_MIN_CALL_S and twice as long as the first (so the cost per token shows over the fixed
# part), or PROBE_CALL_S; then a line through them extrapolates. Keeps the probe to seconds.
PROBE_MIN_CALL_S = 0.25
PROBE_CALL_S = 2.0
SERIALIZE_SAMPLE_BYTES = 64 << 20


@dataclass
class Timing:
    """Seconds per call as a function of the tokens in the call: a least-squares line through the
    measured points (a fixed part, e.g. reading every weight once, plus a cost per token)."""

    points: list[tuple[int, float]] = field(default_factory=list)

    def __call__(self, tokens: int) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * tokens

    def line(self) -> tuple[float, float]:
        """``(fixed seconds, seconds per token)``, both at least 0."""
        ns, ts = [n for n, _ in self.points], [t for _, t in self.points]
        mean_n, mean_t = sum(ns) / len(ns), sum(ts) / len(ts)
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self.points) / var if var else 0.0
        if slope <= 0:  # one point, or timing noise: proportional to the tokens
            return 0.0, max(ts) / max(ns)
        fixed = mean_t - slope * mean_n
        return (fixed, slope) if fixed >= 0 else (0.0, sum(ts) / sum(ns))

    def describe(self) -> str:
        return f"{self.points[0][0]}..{self.points[-1][0]} tokens" if self.points else "-"


@dataclass
class Probe:
    """What the probe measured (seconds, bytes) on a stand-in of the starting model."""

    device: str
    threads: int
    dtype: str
    config_s: float  # reading the starting model's config (as the run's preflight does)
    build_s: float  # building the model object from its config (scratch: with its initialisation)
    param_bytes: int
    forward_backward: Timing
    forward: Timing
    optimizer_s: dict[str, float]
    optimizer_bytes: dict[str, int]
    measures_s: float
    write_bps: float  # weights serialised per second (safetensors)
    read_bps: float
    copy_bps: float
    trainer_import_s: float  # importing transformers' Trainer (once per run)
    seconds: float = 0.0
    moe: bool = False  # routed experts: evaluation also counts their selections (one more pass per model)
    # a ``bf16`` trainer stage: its steps are still timed in the model's dtype (autocast's per-call weight casts
    # swamp the probe's small calls), so the estimate is high where bfloat16 products are fast
    bf16_training: bool = False


# -- the probe ----------------------------------------------------------------------------------


def run_probe(recipe: Recipe, device: str, config_s: float = 0.0) -> Probe:
    """Time the operations the run repeats, on a stand-in of the starting model on ``device``."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the stand-in's config and loss warnings are not the user's business
    try:
        return _probe(recipe, device, config_s)
    finally:
        hf_logging.set_verbosity(verbosity)


def _probe(recipe: Recipe, device: str, config_s: float) -> Probe:
    from sinv_prune.pipeline.routing import is_moe

    start = time.perf_counter()
    model, build_s = _stand_in(recipe, device)
    vocab = model.get_input_embeddings().num_embeddings
    seq_len = recipe.data.seq_len
    fb_batch = max([s.batch_size for s in _trainer_specs(recipe)] + [recipe.score.batch_size])
    fwd_batch = max(recipe.evaluate.window_batch_size, recipe.evaluate.speed_batch_size)
    model.train()
    forward_backward = _grow(lambda b, n: _forward_backward(model, b, n, vocab, device), fb_batch, seq_len, device)
    optimizer_s, optimizer_bytes = {}, {}
    for spec in _trainer_specs(recipe):
        if spec.optimizer not in optimizer_s:
            optimizer_s[spec.optimizer], optimizer_bytes[spec.optimizer] = _optimizer_step(model, spec, device)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.inference_mode():
        forward = _grow(lambda b, n: _forward(model, b, n, vocab), fwd_batch, seq_len, device)
    write_bps, read_bps, copy_bps = _serialize_rates(model)
    trainer_import_s = _trainer_import_s() if _trainer_specs(recipe) else 0.0
    return Probe(
        device=str(device),
        threads=torch.get_num_threads(),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        config_s=config_s,
        build_s=build_s,
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        forward_backward=forward_backward,
        forward=forward,
        optimizer_s=optimizer_s,
        optimizer_bytes=optimizer_bytes,
        measures_s=_measures_s(model) if _needs_measures(recipe) else 0.0,
        write_bps=write_bps,
        read_bps=read_bps,
        copy_bps=copy_bps,
        trainer_import_s=trainer_import_s,
        seconds=time.perf_counter() - start,
        moe=is_moe(model),
        bf16_training=any(s.bf16 for s in _trainer_specs(recipe)),
    )


def _stand_in(recipe: Recipe, device: str):
    """The starting model's architecture and size; pretrained weights replaced by cheap values."""
    import transformers
    from transformers.initialization import no_init_weights

    from sinv_prune.pipeline.recipe import SCRATCH_ARCHITECTURES
    from sinv_prune.pipeline.starting_model import scratch_config, starting_config

    start = time.perf_counter()
    if recipe.model.scratch:
        cls = getattr(transformers, SCRATCH_ARCHITECTURES[recipe.model.architecture][1])
        model = cls(scratch_config(recipe, vocab_size=run_vocab_size(recipe)))  # initialised, as the run
        model.to(_dtype(recipe, model.config))
    else:
        config, cls = starting_config(recipe)
        with no_init_weights():  # buffers (positions, rotary frequencies) are still set
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
        model.to(_dtype(recipe, config))
        _fill(model)
    model.to(device)
    return model, time.perf_counter() - start


def run_vocab_size(recipe: Recipe) -> int:
    """The vocabulary the run's trained tokenizer will have, as far as the corpus can be read here.

    A word tokenizer keeps every distinct word of the train split (plus its special tokens), at most
    ``vocab_size``: the synthetic corpus has a few hundred words, not the default 8,000, and the LM
    head and its loss over 8,000 classes would dominate a small model's probe (the quickstart's
    estimate was 2.6x the run). BPE (and an unreadable corpus) take ``vocab_size``.
    """
    spec = recipe.data.tokenizer
    if spec.kind != "word":
        return spec.vocab_size
    lines = _split_texts(recipe).get("train")
    if not lines:
        return spec.vocab_size
    words = {word for line in lines for word in line.split()}
    specials = 7 if recipe.model.architecture in ("bert", "roberta") else 4  # data.train_tokenizer's
    return min(spec.vocab_size, len(words) + specials)


def _fill(model) -> None:
    """Small varied values, tiled from one short random block (drawing every weight takes seconds)."""
    block = torch.empty(1 << 16).uniform_(-0.02, 0.02)
    with torch.no_grad():
        for p in model.parameters():
            flat, size = p.view(-1), len(block)
            rows = flat.numel() // size
            flat[: rows * size].view(rows, size).copy_(block.expand(rows, size))
            flat[rows * size :].copy_(block[: flat.numel() - rows * size])


def _dtype(recipe: Recipe, config) -> torch.dtype:
    """The run's dtype: ``model.dtype`` when set; else float32 from scratch or GGUF, else the config's."""
    from sinv_prune.pipeline.model_settings import torch_dtype

    if torch_dtype(recipe) is not None:
        return torch_dtype(recipe)
    if recipe.model.scratch:
        return torch.float32
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if recipe.model.gguf_file or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return torch.float32
    return dtype


def _grow(call, batch: int, seq_len: int, device) -> Timing:
    """Time ``call(batch, length)`` at growing sizes up to ``batch x seq_len`` (see ``PROBE_CALL_S``).

    The first call warms up and is not counted, and each size counts the faster of two calls: the
    first call at a new size also allocates its buffers (and faults their pages in), which the run's
    thousands of same-sized steps pay once, so timing it alone overstated the step time.
    """
    shapes = [(1, n) for n in _doubling(min(16, seq_len), seq_len)] + [(b, seq_len) for b in _doubling(2, batch)]
    call(*shapes[0])
    timing = Timing()
    for b, n in shapes:
        seconds = []
        for _ in range(2):
            synchronize(device)
            start = time.perf_counter()
            call(b, n)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        timing.points.append((b * n, min(seconds)))
        last, first = timing.points[-1][1], timing.points[0][1]
        if len(timing.points) > 1 and (last >= max(PROBE_MIN_CALL_S, 2 * first) or last >= PROBE_CALL_S):
            break
    return timing


def _doubling(first: int, last: int) -> list[int]:
    out = []
    n = first
    while n < last:
        out.append(n)
        n *= 2
    return out + [last] if first <= last else out


def _inputs(batch: int, length: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), device=device)


def _forward_backward(model, batch: int, length: int, vocab: int, device) -> None:
    ids = _inputs(batch, length, vocab, device)
    model(input_ids=ids, labels=ids).loss.backward()


def _forward(model, batch: int, length: int, vocab: int) -> None:
    device = model.get_input_embeddings().weight.device
    model(input_ids=_inputs(batch, length, vocab, device))


def _optimizer_step(model, spec: TrainSpec, device) -> tuple[float, int]:
    """Seconds of one optimizer step (the second: the first allocates its state) and the state's bytes."""
    from sinv_prune.symmetry.optimizers import build_optimizer, optimizer_state_bytes

    params = [p for p in model.parameters() if p.grad is not None]
    kwargs = {"lr": spec.learning_rate, "weight_decay": spec.weight_decay, **spec.optimizer_args}
    try:
        optimizer = build_optimizer(spec.optimizer, params, **kwargs)
    except (TypeError, ValueError, ImportError):
        optimizer = build_optimizer("adamw", params, lr=spec.learning_rate)
    loss = torch.ones(())
    optimizer.step(lambda: loss)
    synchronize(device)
    start = time.perf_counter()
    optimizer.step(lambda: loss)
    synchronize(device)
    return time.perf_counter() - start, optimizer_state_bytes(optimizer)


def _serialize_rates(model) -> tuple[float, float, float]:
    """Bytes per second writing and reading weights as safetensors (in memory) and copying them, on a sample."""
    import safetensors.torch

    sample, size = {}, 0
    for name, p in model.named_parameters():
        sample[name] = p.detach().to("cpu").contiguous()
        size += p.numel() * p.element_size()
        if size >= SERIALIZE_SAMPLE_BYTES:
            break
    start = time.perf_counter()
    blob = safetensors.torch.save(sample)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    safetensors.torch.load(blob)
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    [t.clone() for t in sample.values()]
    copy_s = time.perf_counter() - start
    return tuple(size / max(s, 1e-6) for s in (write_s, read_s, copy_s))


def _trainer_import_s() -> float:
    """Seconds to import transformers' Trainer (and accelerate): the first Trainer of a run pays them."""
    start = time.perf_counter()
    from transformers import Trainer  # noqa: F401

    return time.perf_counter() - start


def _needs_measures(recipe: Recipe) -> bool:
    criteria = [p.criterion for a in recipe.prune.arms for p in a.part_specs] + list(recipe.score.criteria)
    return "sinv_static" in criteria or any(s.tracking is not None for s in _trainer_specs(recipe))


def _measures_s(model) -> float:
    """Seconds of :func:`~sinv_prune.scoring.measures.head_measures`, from its first layer times the layer count."""
    from sinv_prune.arch import get_adapter
    from sinv_prune.scoring.measures import layer_measures

    adapter = get_adapter(model)
    start = time.perf_counter()
    with torch.no_grad():
        layer_measures(adapter, 0)
    return (time.perf_counter() - start) * adapter.num_layers


def _trainer_specs(recipe: Recipe) -> list[TrainSpec]:
    return [s for s in (recipe.train, recipe.finetune) if s is not None]


# -- token counts --------------------------------------------------------------------------------


def split_tokens(recipe: Recipe) -> dict[str, int]:
    """Tokens per split, estimated from the text: words (+1 a line) for a word tokenizer, else
    characters / ``CHARS_PER_TOKEN``. Empty where the corpus cannot be read (a Hub dataset not cached)."""
    texts = _split_texts(recipe)
    word = recipe.data.tokenizer.kind == "word"
    out = {}
    for split, lines in texts.items():
        if word:
            out[split] = sum(len(line.split()) + 1 for line in lines if line.strip())
        else:
            out[split] = int(sum(len(line) + 1 for line in lines) / CHARS_PER_TOKEN)
    return out


def _split_texts(recipe: Recipe) -> dict[str, list[str]]:
    """Lines per split from local files or the synthetic corpus; nothing for a Hub dataset (not fetched here)."""
    from sinv_prune import data as data_mod

    spec = recipe.data
    if spec.files is not None:
        files = {k: recipe.resolve(v) for k, v in spec.files.model_dump().items() if v is not None}
        return {k: Path(v).read_text(encoding="utf-8").splitlines() for k, v in files.items()}
    if spec.synthetic is not None:
        s = spec.synthetic
        corpus = data_mod.synthetic_corpus(
            num_train=s.num_train, num_valid=s.num_valid, num_test=s.num_test, seed=s.seed
        )
        return {split: corpus[split][0 : len(corpus[split])]["text"] for split in corpus}
    return {}


# -- stage times ---------------------------------------------------------------------------------


def estimate_stages(recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> list[Row]:
    """Seconds per stage (and per arm where a stage works arm by arm) from the probe's measurements."""
    from sinv_prune.pipeline.tasks import estimate_rows as estimate_task_rows

    rows = [_start_row(recipe, probe, tokens), _train_row(recipe, probe, tokens)]
    rows += _score_rows(recipe, probe, tokens)
    copy_save = probe.param_bytes / probe.copy_bps + probe.param_bytes / probe.write_bps
    for arm in recipe.prune.arms:
        rows.append(_prune_row(recipe, arm, probe, tokens, copy_save))
    if recipe.finetune is not None:
        rows += _finetune_rows(recipe, probe, tokens)
    rows.append(_evaluate_row(recipe, probe, tokens))
    rows += estimate_task_rows(recipe, probe)
    if recipe.export is not None and recipe.export.gguf is not None:
        rows.append(_export_row(recipe, probe))
    rows.append(Row("report", REPORT_S, "report.md and plots (fixed allowance)"))
    return rows


#: Forward passes over the calibration tokens one compensation costs (lsq: the shared stream, then a
#: teacher pass, a fitting pass stopped at the projection and a student pass per pruned block; obs as lsq,
#: its selection costs little beside them; the held-out comparison adds two forwards over 1/8 of the tokens).
COMPENSATION_FORWARDS = {"lsq": 2.6, "obs": 2.6, "bias": 1.3}
#: Forwards over the calibration tokens shrink's statistics pass costs (a forward plus the consumers' Gram
#: products) and its closing held-out comparison (up to three passes over 1/8 of them).
SHRINK_FORWARDS = 2.5


def _finetune_rows(recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> list[Row]:
    """The teacher cache (once, ``distill.cache_top_k``), then every arm's fine-tune with its recovery-curve points."""
    spec, seq_len = recipe.finetune, recipe.data.seq_len
    split_tokens_ = None if spec.data is not None else tokens.get("train" if "train" in tokens else "valid")
    steps = _steps(spec, seq_len, split_tokens_)
    load = probe.build_s + probe.param_bytes / probe.read_bps
    rows = []
    generate = spec.data.generate if spec.data is not None else None
    if generate is not None:  # each new token one forward of the batch (its cache's attention not counted)
        blocks = steps * spec.batch_size * spec.gradient_accumulation_steps
        new = seq_len - generate.prompt_tokens
        seconds = math.ceil(blocks / generate.batch_size) * new * probe.forward(generate.batch_size)
        rows.append(Row("teacher text", seconds, f"base model writes {blocks} blocks of {new} new tokens"))
    if spec.distill is not None and spec.distill.cache_top_k:
        blocks = steps * spec.batch_size * spec.gradient_accumulation_steps
        if split_tokens_ is not None:
            blocks = min(blocks, split_tokens_ // seq_len)
        k = spec.distill.cache_top_k
        size = blocks * seq_len * k * (6 if spec.distill.cache_dtype == "float16" else 8)
        batch = recipe.evaluate.window_batch_size  # the cache's teacher batches
        seconds = load + math.ceil(blocks / batch) * probe.forward(batch * seq_len) + size / probe.write_bps
        what = f"teacher over {blocks * seq_len:,} tokens, top-{k}: {size / 1e9:.2f} GB"
        rows.append(Row("distill cache", seconds, what))
    curve = _curve_s(recipe, probe, tokens, steps)
    for i, arm in enumerate(recipe.prune.arms):
        first = recipe.train is None and i == 0
        seconds, what = _trainer_s(spec, probe, seq_len, split_tokens_, first=first)
        if curve:
            what += f"; {curve[1]} recovery-curve points"
        rows.append(Row(f"finetune {arm.label}", load + seconds + (curve[0] if curve else 0.0), what))
    return rows


def _curve_s(recipe: Recipe, probe: Probe, tokens: dict[str, int], steps: int) -> tuple[float, int] | None:
    """Seconds and points of one arm's recovery curve: perplexity windows and ``evaluate.tasks`` per point."""
    from sinv_prune.pipeline.tasks import task_seconds
    from sinv_prune.pipeline.training import tokens_per_step

    spec, data = recipe.finetune, recipe.data
    if spec.eval_every_tokens is None:
        return None
    seen = steps * tokens_per_step(spec, data.seq_len)
    points = 2 + seen // spec.eval_every_tokens  # 0 tokens, every multiple, the end
    split = "test" if "test" in tokens else "valid"
    limit = spec.eval_max_tokens or data.max_eval_tokens or math.inf
    n = min(tokens.get(split, 0), limit)
    windows = math.ceil(max(n - data.seq_len, 0) / (data.eval_stride or data.seq_len)) + 1
    batch = recipe.evaluate.window_batch_size
    tasks = task_seconds(recipe, probe)[0] if recipe.evaluate.tasks and spec.eval_tasks else 0.0
    return points * (math.ceil(windows / batch) * probe.forward(batch * data.seq_len) + tasks), points


def _prune_row(recipe: Recipe, arm, probe: Probe, tokens: dict[str, int], copy_save: float) -> Row:
    """Copy, cut and save; plus compensation (every round) and the re-scoring of rounds after the first."""
    seconds, what = copy_save, "copy the base model, cut, save"
    if arm.pruned is not None:
        return Row(f"prune {arm.label}", copy_save, f"load {arm.pruned}, save")
    if arm.compensate is not None:
        calibration = arm.compensate.batches * arm.compensate.batch_size * recipe.data.seq_len
        seconds += arm.rounds * COMPENSATION_FORWARDS[arm.compensate.method] * probe.forward(calibration)
        what += f"; {arm.compensate.method} compensation on {calibration:,} tokens"
    if arm.auto is not None:
        seconds += SHRINK_FORWARDS * probe.forward(arm.auto.batches * recipe.data.seq_len)
        seconds += arm.auto.budget * probe.forward(4 * min(256, recipe.data.seq_len))
        what += f"; shrink: statistics on {arm.auto.batches} sequences, {arm.auto.budget} plans of KL"
    if arm.rounds > 1:
        rescore = sum(_score_seconds(p.criterion, recipe, probe, tokens)[0] for p in arm.part_specs)
        seconds += (arm.rounds - 1) * rescore
        what += f"; {arm.rounds} rounds, re-scored {arm.rounds - 1}x"
    return Row(f"prune {arm.label}", seconds, what)


def _start_row(recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> Row:
    """Preflight, corpus, tokenizer and the starting model's load."""
    seconds = probe.config_s + sum(tokens.values()) / TOKENIZE_TOKENS_PER_S
    if recipe.model.scratch:
        return Row("start", seconds, "check the recipe, read and tokenise the corpus")
    # A GGUF file is parsed again for the tokenizer and for the weights (then dequantised).
    parses = 2 if recipe.model.gguf_file else 0
    seconds += parses * probe.config_s + probe.build_s + probe.param_bytes / probe.read_bps
    return Row("start", seconds, "check the recipe, read and tokenise the corpus, load the model")


def _train_row(recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> Row:
    save = probe.param_bytes / probe.write_bps
    if recipe.train is None:
        return Row("train", save, "no training: save the starting model as base/")
    seconds, what = _trainer_s(recipe.train, probe, recipe.data.seq_len, tokens.get("train"), first=True)
    if recipe.train.eval_every and "valid" in tokens:
        evals = _steps(recipe.train, recipe.data.seq_len, tokens.get("train")) // recipe.train.eval_every
        blocks = tokens["valid"] // recipe.data.seq_len
        seconds += (
            evals
            * math.ceil(blocks / recipe.train.batch_size)
            * probe.forward(recipe.train.batch_size * recipe.data.seq_len)
        )
    if recipe.train.tracking is not None:
        steps = _steps(recipe.train, recipe.data.seq_len, tokens.get("train"))
        seconds += (steps // recipe.train.tracking.every_n_steps + 1) * probe.measures_s
    if recipe.model.scratch:
        seconds += probe.build_s  # a pretrained model's load is in "start"
    return Row("train", seconds, what)


def _steps(spec: TrainSpec, seq_len: int, split_tokens_: int | None) -> int:
    from sinv_prune.pipeline.step_budget import planned_steps

    if planned_steps(spec, seq_len):  # max_steps, or a fine-tune's token budget (one process)
        return planned_steps(spec, seq_len)
    blocks = (split_tokens_ or 0) // seq_len
    return math.ceil(spec.epochs * math.ceil(blocks / spec.batch_size))


def _trainer_s(
    spec: TrainSpec, probe: Probe, seq_len: int, split_tokens_: int | None, *, first: bool
) -> tuple[float, str]:
    """A Trainer run: its steps, its checkpoints (weights + optimizer state) and the final save;
    the ``first`` of the run also imports the Trainer."""
    steps = _steps(spec, seq_len, split_tokens_)
    micro = spec.batch_size * seq_len
    accumulation = spec.gradient_accumulation_steps
    step_s = accumulation * probe.forward_backward(micro) + probe.optimizer_s.get(spec.optimizer, 0.0)
    distill = getattr(spec, "distill", None)
    if distill is not None and not distill.cache_top_k:
        step_s += accumulation * probe.forward(micro)  # the teacher's forward (a cache runs it once: its own row)
    checkpoints = math.ceil(steps / spec.save_every)
    checkpoint_bytes = probe.param_bytes + probe.optimizer_bytes.get(spec.optimizer, 0)
    saves = (checkpoints * checkpoint_bytes + probe.param_bytes) / probe.write_bps
    seconds = TRAINER_START_S + (probe.trainer_import_s if first else 0.0) + steps * step_s + saves
    what = f"{steps} steps of {spec.batch_size}x{seq_len}"
    what += f"x{accumulation}" if accumulation > 1 else ""
    return seconds, f"{what} tokens at {step_s:.2f}s, {checkpoints} checkpoint(s)"


def _score_rows(recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> list[Row]:
    from sinv_prune.pipeline.stages import criterion_key
    from sinv_prune.scoring.criteria import criterion_class

    wanted = {name: name for name in recipe.score.criteria}
    for arm in recipe.prune.arms:
        for part in arm.part_specs:
            wanted.setdefault(criterion_key(part), part.criterion)
    rows = []
    for key, name in wanted.items():
        if name == "random" or criterion_class(name).needs_trace:
            continue  # drawn per arm, or read from the training trace: no work
        rows.append(Row(f"score {key}", *_score_seconds(name, recipe, probe, tokens)))
    return rows


def _score_seconds(name: str, recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> tuple[float, str]:
    """One scoring of the model by criterion ``name``: seconds and what they pay for."""
    from sinv_prune.scoring.criteria import criterion_class

    spec, seq_len = recipe.score, recipe.data.seq_len
    split = "valid" if "valid" in tokens else ("train" if "train" in tokens else "test")
    blocks = tokens.get(split, spec.batches * spec.batch_size * seq_len) // seq_len
    batches = math.ceil(min(spec.batches * spec.batch_size, blocks) / spec.batch_size)
    cls = criterion_class(name)
    if name == "random" or cls.needs_trace:
        return 0.0, "no work"
    if name.startswith("sinv"):
        return probe.measures_s, "S-invariant measures of every head"
    if cls.needs_data:
        forward_only = name in ("entropy", "activation", "frequency", "reap", "ean")
        per_batch = (probe.forward if forward_only else probe.forward_backward)(spec.batch_size * seq_len)
        return batches * per_batch, f"{batches} batches of {spec.batch_size}x{seq_len} tokens"
    return probe.param_bytes / probe.read_bps, "one pass over the weights"


def _evaluate_row(recipe: Recipe, probe: Probe, tokens: dict[str, int]) -> Row:
    """Baseline and every arm (pruned, and fine-tuned if the recipe fine-tunes): perplexity and speed (and a
    mixture-of-experts model's routing statistics)."""
    spec, data = recipe.evaluate, recipe.data
    split = "test" if "test" in tokens else "valid"
    n = min(tokens.get(split, data.max_eval_tokens or 0), data.max_eval_tokens or math.inf)
    stride = data.eval_stride or data.seq_len
    windows = math.ceil(max(n - data.seq_len, 0) / stride) + 1
    eval_s = math.ceil(windows / spec.window_batch_size) * probe.forward(spec.window_batch_size * data.seq_len)
    if probe.moe:  # the routing statistics: non-overlapping windows over the same tokens
        blocks = max(n // data.seq_len, 1)
        eval_s += math.ceil(blocks / spec.window_batch_size) * probe.forward(spec.window_batch_size * data.seq_len)
    if spec.speed:
        speed_tokens = spec.speed_batch_size * (spec.speed_seq_len or data.seq_len)
        eval_s += 2 * (3 + spec.speed_repeats) * probe.forward(speed_tokens)  # warm-up + repeats, two models
    arms = recipe.evaluated_models - 1  # arm models (a control arm's pruned one is the baseline)
    load = probe.build_s + probe.param_bytes / probe.read_bps
    what = f"{1 + arms} models x {windows} windows of {data.seq_len} tokens" + (" + speed" if spec.speed else "")
    what += " + expert routing" if probe.moe else ""
    return Row("evaluate", (1 + arms) * eval_s + arms * load, what)


def _export_row(recipe: Recipe, probe: Probe) -> Row:
    """``export.gguf``: per model (baseline + arms) load, convert to float32, quantize (rate measured
    here on a 1M-value sample), write, and the round-trip check (llama.cpp reads the file back and
    runs a short prompt; counted as a read and two forwards)."""
    import gguf
    import numpy as np

    from sinv_prune.deploy.gguf_tensors import QTYPES

    qtype = QTYPES.get(recipe.export.gguf.type, QTYPES["q8_0"])  # K-quants: llama.cpp's quantiser, timed as Q8_0
    sample = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    start = time.perf_counter()
    gguf.quants.quantize(sample, qtype)
    quantize_bps = sample.nbytes / max(time.perf_counter() - start, 1e-6)
    f32_bytes = probe.param_bytes * 32 // torch.finfo(getattr(torch, probe.dtype)).bits
    one = f32_bytes / probe.copy_bps + f32_bytes / quantize_bps + f32_bytes / probe.write_bps
    one += f32_bytes / probe.read_bps + 2 * probe.forward(24)  # the check
    arms = len(recipe.prune.arms)
    load = probe.build_s + probe.param_bytes / probe.read_bps
    from sinv_prune.deploy.gguf_verify import llama_cpp_available

    checked = recipe.export.gguf.verify if recipe.export.gguf.verify is not None else llama_cpp_available()
    what = f"{1 + arms} GGUF files ({recipe.export.gguf.type})" + (", each checked in llama.cpp" if checked else "")
    return Row("export", (1 + arms) * one + arms * load, what)


# -- the table -------------------------------------------------------------------------------------


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m 05s``, ``1h 25m``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def estimate_table(rows: list[Row], probe: Probe) -> str:
    """The per-stage table with its total, and what the numbers come from."""
    width = max(len(r.stage) for r in rows + [Row("total", 0, "")])
    bf16 = " (bf16 training timed as that: faster where bfloat16 is)" if probe.bf16_training else ""
    lines = [
        f"estimated time (an estimate, not a promise: from a {probe.seconds:.1f}s probe on {probe.device}, "
        f"{probe.threads} thread(s), {probe.dtype}{bf16}; forward+backward timed at "
        f"{probe.forward_backward.describe()}, forward at {probe.forward.describe()}, extrapolated linearly):"
    ]
    lines += [f"  {r.stage:<{width}}  {format_seconds(r.seconds):>8}  {r.what}" for r in rows]
    lines.append(f"  {'total':<{width}}  {format_seconds(sum(r.seconds for r in rows)):>8}")
    return "\n".join(lines)


# -- memory (the prune stage's peak, from the memory model) -------------------------------------


def prune_memory(recipe: Recipe, device: str):
    """The prune stage's predicted peak: ``(arm label, task, Prediction, sequences option)`` of the arm that needs
    most on the binding memory (the device; the host on the CPU), or None for a recipe that prunes nothing.

    Per arm: an ``auto`` arm is a shrink (``auto.batches`` sequences of ``data.seq_len``); ``compensate`` a
    compensation pass (``batches x batch_size`` sequences); a part whose criterion reads calibration data a
    criterion pass (``score.batches x score.batch_size``; ``taylor``'s backward through the whole model is
    counted as one block's, so its estimate is low); anything else a plain removal.
    """
    from sinv_prune.pipeline import memory_model
    from sinv_prune.pipeline.starting_model import starting_config
    from sinv_prune.scoring.criteria.registry import criterion_class

    config, cls = starting_config(recipe)
    shape = memory_model.shape_of(config, cls, _dtype(recipe, config))
    length = recipe.data.seq_len
    offload = getattr(recipe.model, "offload", None) or "none"
    best = None
    for arm in recipe.prune.arms:
        if arm.control or arm.pruned is not None:
            continue
        if arm.auto is not None:
            task, options, flag = "shrink", {"sequences": arm.auto.batches, "refine": arm.auto.refine}, "auto.batches"
        elif arm.compensate is not None:
            c = arm.compensate
            task, options, flag = (
                "compensate",
                {"sequences": c.batches * c.batch_size, "batch": c.batch_size},
                ("compensate.batches"),
            )
        elif any(getattr(criterion_class(p.criterion), "needs_data", False) for p in arm.part_specs):
            s = recipe.score
            task, options, flag = (
                "criterion",
                {"sequences": s.batches * s.batch_size, "batch": s.batch_size},
                ("score.batches"),
            )
        else:
            task, options, flag = "plain", {"sequences": 0}, "score.batches"
        pred = memory_model.predict(shape, task, length=length, device=device, offload=offload, **options)
        key = pred.host_peak if pred.on_cpu else pred.device_peak
        if best is None or key > best[0]:
            best = (key, arm.label, task, pred, flag, options)
    if best is None:
        return None
    _, label, task, pred, flag, options = best
    return label, task, pred, flag, {"shape": shape, "length": length, "offload": offload, **options}


def memory_check(recipe: Recipe, device: str) -> tuple[list[str], str | None]:
    """The dry run's memory lines for the prune stage and the one-line refusal (None: it fits)."""
    from sinv_prune.pipeline import memory_model

    found = prune_memory(recipe, device)
    if found is None:
        return [], None
    label, task, pred, flag, options = found
    shape = options.pop("shape")
    fewer = f"at most {{}} calibration sequences in arm {label} ({flag})"
    lines, refused = memory_model.dry_run_check(shape, task, device, sequences_option=fewer,
                                                offload_option=None, **options)  # fmt: skip
    return [f"prune stage, memory of arm {label} ({task}, the largest):", *lines], refused
