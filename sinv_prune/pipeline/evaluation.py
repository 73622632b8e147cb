"""Evaluation: perplexity, masked-LM loss, parameter breakdown and speed.

The exact methods are described in ``docs/evaluation.md``. Every function puts the model
in eval mode for the measurement and restores its previous mode; inputs go to ``device``
(default: the device of the model's input embeddings; the model itself is never moved).
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.pipeline.device_choice import synchronize
from sinv_prune.surgery.removal import count_parameters

PERPLEXITY_METHOD = "strided-window"
MLM_METHOD = "fixed-mask"


# -- helpers -----------------------------------------------------------------------------------


def _input_device(model: nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def _accepts(model: nn.Module, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params


def _max_positions(model: nn.Module) -> int | None:
    """Learned absolute positions limit the window; rotary models report a nominal limit only."""
    config = model.config
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _vocab_size(model: nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


def _progress(total: int, desc: str, enabled: bool, unit: str):
    """A bar that disappears when done (``leave=False``): a run evaluates many models, and each finished
    one leaves its result line in the log instead of a full bar."""
    from sinv_prune.progress import bar

    return bar(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True, leave=False)


class _EvalMode:
    """Eval mode within the block, previous mode restored after."""

    def __init__(self, *models: nn.Module):
        self.models = models

    def __enter__(self):
        self.modes = [m.training for m in self.models]
        for m in self.models:
            m.eval()

    def __exit__(self, *exc):
        for m, mode in zip(self.models, self.modes, strict=True):
            m.train(mode)


def _stream(ids, max_tokens: int | None) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"ids must be one token stream (1-D), got shape {tuple(ids.shape)}")
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        ids = ids[:max_tokens]
    return ids.cpu()


# -- perplexity --------------------------------------------------------------------------------


def perplexity_windows(num_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows of :func:`perplexity`: ``(begin, end, first_scored)`` in stream positions.

    A window holds tokens ``begin..end-1`` and scores (predicts) tokens ``first_scored..end-1``,
    exactly those the previous window did not score; the first window scores all but its
    first token. Windows start every ``stride`` tokens until one reaches the end.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in 1..seq_len ({seq_len}), got {stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + seq_len, num_tokens)
        windows.append((begin, end, max(begin + 1, prev_end)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def perplexity(
    model: nn.Module,
    ids,
    *,
    seq_len: int,
    stride: int | None = None,
    batch_size: int = 8,
    device=None,
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Token-weighted perplexity of a causal LM over one token stream with strided windows.

    The Hugging Face "perplexity of fixed-length models" method: windows of ``seq_len``
    tokens start every ``stride`` tokens (default ``seq_len``: no overlap); each scores only
    the tokens the previous window did not, so with ``stride < seq_len`` every token but the
    first is scored exactly once, with at least ``seq_len - stride`` tokens of context. The
    first window scores all but its first token; with ``stride == seq_len`` the first token of
    every window goes unscored. Windows of equal length run ``batch_size`` at a time.
    ``max_tokens`` evaluates only the first ``max_tokens`` tokens of ``ids``.

    Returns ``{"nll": mean NLL (nats) per scored token, "perplexity": exp(nll), "tokens":
    scored tokens, "windows", "seq_len", "stride", "method"}``; NLL is summed in float64.
    """
    stride = seq_len if stride is None else stride
    ids = _stream(ids, max_tokens)
    limit = _max_positions(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len {seq_len} exceeds the model's {limit} positions")
    windows = perplexity_windows(ids.numel(), seq_len, stride)
    device = _input_device(model, device)
    extra = {"use_cache": False} if _accepts(model, "use_cache") else {}
    keep_logits = _accepts(model, "logits_to_keep")
    batches, current = [], []
    for window in windows:  # consecutive windows of equal length share a batch
        if current and (len(current) == batch_size or _length(current[0]) != _length(window)):
            batches.append(current)
            current = []
        current.append(window)
    batches.append(current)

    total, count = torch.zeros((), dtype=torch.float64, device=device), 0  # on device: no sync per window
    with _EvalMode(model), torch.inference_mode(), _progress(len(windows), "perplexity", progress, "window") as bar:
        for batch in batches:
            length = _length(batch[0])
            inputs = torch.stack([ids[b:e] for b, e, _ in batch]).to(device)
            # Positions p predict token p + 1; the batch needs the last `keep` positions.
            keep = max(e - s for _, e, s in batch) + 1
            kwargs = {"logits_to_keep": keep} if keep_logits else {}
            logits = model(input_ids=inputs, **extra, **kwargs).logits
            logits = logits[:, -keep:] if keep_logits else logits
            offset = length - logits.shape[1]  # window position of logits[:, 0]
            for row, (begin, end, first) in enumerate(batch):
                lo = first - begin - 1 - offset
                hi = end - begin - 1 - offset
                targets = inputs[row, first - begin : end - begin]
                nll = F.cross_entropy(logits[row, lo:hi].float(), targets, reduction="sum")
                total += nll.double()
                count += targets.numel()
            bar.update(len(batch))
    nll = float(total) / count
    return {
        "nll": nll,
        "perplexity": math.exp(nll),
        "tokens": count,
        "windows": len(windows),
        "seq_len": seq_len,
        "stride": stride,
        "method": PERPLEXITY_METHOD,
    }


def _length(window: tuple[int, int, int]) -> int:
    return window[1] - window[0]


# -- masked-LM loss ----------------------------------------------------------------------------


def mlm_mask(
    ids,
    *,
    mask_token_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    seed: int = 0,
    strategy: str = "mask",
    special_ids: Iterable[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The corrupted stream and the boolean mask of positions to predict, for :func:`mlm_loss`.

    One ``torch.Generator`` seeded with ``seed`` draws, for every stream position in order,
    a selection number, a replacement number and a random token, so the selected positions
    depend only on ``(ids, mask_prob, seed, special_ids)`` (not on ``seq_len``, the batch size
    or the strategy). Positions holding ``special_ids`` or ``mask_token_id`` are never selected.
    ``strategy="mask"`` replaces every selected token by ``mask_token_id``; ``"bert"`` does
    80% ``[MASK]``, 10% a random non-special token, 10% unchanged.
    """
    if strategy not in ("mask", "bert"):
        raise ValueError(f"strategy must be 'mask' or 'bert', got {strategy!r}")
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
    special = torch.tensor(sorted({*special_ids, mask_token_id}), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    select = torch.rand(ids.numel(), generator=generator, dtype=torch.float64)
    replace = torch.rand(ids.numel(), generator=generator, dtype=torch.float64)
    ordinary = torch.ones(vocab_size, dtype=torch.bool)
    ordinary[special[special < vocab_size]] = False
    candidates = ordinary.nonzero().reshape(-1)
    random_tokens = candidates[torch.randint(len(candidates), (ids.numel(),), generator=generator)]
    selected = (select < mask_prob) & ~torch.isin(ids, special)
    corrupted = ids.clone()
    if strategy == "mask":
        corrupted[selected] = mask_token_id
    else:
        corrupted[selected & (replace < 0.8)] = mask_token_id
        swap = selected & (replace >= 0.8) & (replace < 0.9)
        corrupted[swap] = random_tokens[swap]
    return corrupted, selected


def mlm_loss(
    model: nn.Module,
    ids,
    *,
    seq_len: int,
    mask_token_id: int,
    special_ids: Iterable[int] = (),
    mask_prob: float = 0.15,
    seed: int = 0,
    strategy: str = "mask",
    cls_id: int | None = None,
    sep_id: int | None = None,
    batch_size: int = 8,
    device=None,
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Masked-LM loss of an encoder on one token stream under a fixed masking.

    The stream (first ``max_tokens`` tokens) is masked by :func:`mlm_mask` (default
    ``strategy="mask"``: every selected token becomes ``[MASK]``; ``"bert"`` for 80/10/10),
    then cut into consecutive blocks of ``seq_len`` tokens (with ``cls_id``/``sep_id``,
    ``[CLS] + seq_len - 2 tokens + [SEP]``, as :func:`sinv_prune.data.lm_blocks`); the final
    shorter block is kept. ``mlm_loss`` is the mean cross-entropy (nats, float64 sum) over all
    selected positions; ``mlm_perplexity = exp(mlm_loss)`` (not a pseudo-perplexity, which
    would mask every token in turn). The same call gives the same positions every time.
    """
    from sinv_prune.data import block_tensor

    ids = _stream(ids, max_tokens)
    limit = _max_positions(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len {seq_len} exceeds the model's {limit} positions")
    specials = {*special_ids, *(t for t in (cls_id, sep_id) if t is not None)}
    corrupted, selected = mlm_mask(
        ids,
        mask_token_id=mask_token_id,
        vocab_size=_vocab_size(model),
        mask_prob=mask_prob,
        seed=seed,
        strategy=strategy,
        special_ids=specials,
    )
    if not selected.any():
        raise ValueError(f"no position selected for masking ({ids.numel()} tokens, mask_prob={mask_prob})")
    # Labels ride along as a second stream: the original id where selected, else -100.
    labels = torch.where(selected, ids, torch.full_like(ids, -100))
    inputs = block_tensor(corrupted, seq_len, cls_id=cls_id, sep_id=sep_id, keep_last=True)
    targets = block_tensor(labels, seq_len, cls_id=-100 if cls_id is not None else None,
                           sep_id=-100 if sep_id is not None else None, keep_last=True)  # fmt: skip
    device = _input_device(model, device)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for x, y in zip(inputs, targets, strict=True)
               for i in range(0, len(x), batch_size)]  # fmt: skip
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    with _EvalMode(model), torch.inference_mode(), _progress(len(batches), "mlm loss", progress, "batch") as bar:
        for x, y in batches:
            scored = int((y != -100).sum())  # counted on the CPU: no device sync
            if scored:
                x, y = x.to(device), y.to(device)
                logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits
                where = y != -100
                total += F.cross_entropy(logits[where].float(), y[where], reduction="sum").double()
                count += scored
            bar.update(1)
    loss = float(total) / count
    return {
        "mlm_loss": loss,
        "mlm_perplexity": math.exp(loss),
        "tokens": count,
        "seq_len": seq_len,
        "mask_prob": mask_prob,
        "seed": seed,
        "strategy": strategy,
        "method": MLM_METHOD,
    }


# -- parameters --------------------------------------------------------------------------------


def parameter_breakdown(model: nn.Module) -> dict[str, int]:
    """Distinct parameters by category: ``{"total", "attention", "embedding", "other"}``.

    * ``attention``: every parameter of each layer's attention module and output projection
      as the architecture adapter names them: Q, K, V and O weights and biases (plus any
      per-head norm living in the attention module, e.g. Qwen3's q/k norms), not layer norms
      outside it;
    * ``embedding``: every ``nn.Embedding`` (token, position, token-type) and the output
      embeddings (LM head) where their weight is not tied to the input embeddings, with their bias;
    * ``other``: the rest (MLPs, norms, pooler and head transforms).

    A parameter shared between modules counts once; ``total`` equals
    :func:`sinv_prune.count_parameters`.
    """
    adapter = get_adapter(model)
    attention: dict[int, int] = {}
    for layer in range(adapter.num_layers):
        for module in (adapter.attention(layer), adapter.out_proj(layer)):
            attention.update((id(p), p.numel()) for p in module.parameters())
    embedding: dict[int, int] = {}
    modules = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        modules.append(output)
    for module in modules:
        embedding.update((id(p), p.numel()) for p in module.parameters() if id(p) not in attention)
    total = count_parameters(model)
    attn, emb = sum(attention.values()), sum(embedding.values())
    return {"total": total, "attention": attn, "embedding": emb, "other": total - attn - emb}


# -- speed -------------------------------------------------------------------------------------


def _speed_inputs(model: nn.Module, batch_size: int, seq_len: int, vocab_size: int | None, seed: int, device):
    vocab = vocab_size or _vocab_size(model)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch_size, seq_len), generator=generator).to(device)
    kwargs = {"use_cache": False} if _accepts(model, "use_cache") else {}
    return {"input_ids": ids, **kwargs}


def _timed(model: nn.Module, inputs: dict, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    model(**inputs)
    synchronize(device)
    return time.perf_counter() - start


class _Placed:
    """With ``offload``: the model is on ``device`` inside the block and on the CPU after; else a no-op."""

    def __init__(self, model: nn.Module, device: torch.device, offload: bool):
        self.model, self.device, self.offload = model, device, offload

    def __enter__(self):
        if self.offload:
            self.model.to(self.device)

    def __exit__(self, *exc):
        if self.offload:
            self.model.to("cpu")


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def fits_together(models: Iterable[nn.Module], device, *, headroom: float = 0.25) -> bool:
    """Whether ``models`` fit on ``device`` at once, with ``headroom`` of their size to spare (activations).

    CUDA: against the free memory plus what of them is on the device already; other devices: True
    (the CPU holds them all anyway).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return True
    models = list(models)
    need = sum(model_bytes(m) for m in models) * (1 + headroom)
    there = sum(model_bytes(m) for m in models if _input_device(m, None).type == "cuda")
    free, _ = torch.cuda.mem_get_info(device)
    return need <= free + there


def _summary(times: list[float], batch_size: int, seq_len: int, device: torch.device, repeats, warmup) -> dict:
    ms = [t * 1000 for t in times]
    median = statistics.median(ms)
    if len(ms) > 1:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    else:
        q1 = q3 = median
    return {
        "latency_ms": median,
        "latency_ms_iqr": q3 - q1,
        "tokens_per_s": batch_size * seq_len / (median / 1000),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "repeats": repeats,
        "warmup": warmup,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


def measure_speed(
    model: nn.Module,
    *,
    batch_size: int = 1,
    seq_len: int = 128,
    repeats: int = 20,
    warmup: int = 3,
    device=None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> dict:
    """Forward latency on random token ids (seeded), in eval mode under ``torch.inference_mode``.

    ``warmup`` untimed forwards, then ``repeats`` timed ones (``time.perf_counter``, CUDA
    synchronised before and after each). Returns ``{"latency_ms": median, "latency_ms_iqr":
    interquartile range, "tokens_per_s": batch_size * seq_len / median, "batch_size",
    "seq_len", "repeats", "warmup", "device", "threads"}``. No KV cache (``use_cache=False``).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = _input_device(model, device)
    inputs = _speed_inputs(model, batch_size, seq_len, vocab_size, seed, device)
    with _EvalMode(model), torch.inference_mode():
        for _ in range(warmup):
            _timed(model, inputs, device)
        times = [_timed(model, inputs, device) for _ in range(repeats)]
    return _summary(times, batch_size, seq_len, device, repeats, warmup)


def compare_speed(
    model_a: nn.Module,
    model_b: nn.Module,
    *,
    batch_size: int = 1,
    seq_len: int = 128,
    repeats: int = 20,
    warmup: int = 3,
    device=None,
    vocab_size: int | None = None,
    seed: int = 0,
    control: bool = False,
    offload: bool = False,
) -> dict:
    """Latency of two models measured interleaved in one process, on the same inputs.

    After ``warmup`` forwards of each, repetition ``i`` times one forward of each model back
    to back, rotating which goes first (AB, BA, ...), so drift in machine load hits both alike.
    Returns ``{"a": ..., "b": ...}`` (as :func:`measure_speed`), ``"latency_ratio"`` (median
    over repetitions of ``t_b / t_a``), ``"speedup"`` (``1 / latency_ratio``: > 1 when ``b``
    is faster, e.g. ``compare_speed(original, pruned)``) and the spread of the per-repetition
    speed-ups ``t_a / t_b``: ``"speedup_iqr"`` ``[q1, q3]`` and ``"speedup_range"`` ``[min, max]``.

    ``control=True`` adds an A/A control: each repetition also times ``model_a`` a second time
    (the three forwards rotate: ABA', BA'A, A'AB), and ``"control"`` holds ``t_a / t_a'`` as
    ``{"speedup", "speedup_iqr", "speedup_range"}``; ``"resolved"`` says whether the speed-up is
    outside that noise (:func:`speedup_resolved`).

    ``offload=True`` is for two models that do not fit on ``device`` together: both wait on the
    CPU, and each goes to ``device`` for its turn (with ``min(warmup, 1)`` untimed forwards on
    arrival, so the move is not timed) and back after it; at the end each model returns to the
    device it came from. The order, the control and the statistics are the same.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = _input_device(model_a, device)
    homes = [_input_device(m, None) for m in (model_a, model_b)]
    vocab = vocab_size or min(_vocab_size(model_a), _vocab_size(model_b))
    inputs_a = _speed_inputs(model_a, batch_size, seq_len, vocab, seed, device)
    inputs_b = _speed_inputs(model_b, batch_size, seq_len, vocab, seed, device)
    runs = {"a": (model_a, inputs_a), "b": (model_b, inputs_b)}
    if control:
        runs["a2"] = runs["a"]
    order = list(runs)
    times: dict[str, list[float]] = {name: [] for name in order}
    rewarm = min(warmup, 1) if offload else 0
    if offload:
        model_a.to("cpu"), model_b.to("cpu")
    try:
        with _EvalMode(model_a, model_b), torch.inference_mode():
            for _ in range(warmup):
                for name in order:
                    with _Placed(runs[name][0], device, offload):
                        _timed(*runs[name], device)
            for i in range(repeats):
                shift = i % len(order)
                for name in order[shift:] + order[:shift]:
                    with _Placed(runs[name][0], device, offload):
                        for _ in range(rewarm):
                            _timed(*runs[name], device)
                        times[name].append(_timed(*runs[name], device))
    finally:
        if offload:
            model_a.to(homes[0]), model_b.to(homes[1])
    ratio = statistics.median(b / a for a, b in zip(times["a"], times["b"], strict=True))
    out = {
        "a": _summary(times["a"], batch_size, seq_len, device, repeats, warmup),
        "b": _summary(times["b"], batch_size, seq_len, device, repeats, warmup),
        "latency_ratio": ratio,
        "speedup": 1.0 / ratio,
        **_spread([a / b for a, b in zip(times["a"], times["b"], strict=True)]),
    }
    if control:
        ratios = [a / a2 for a, a2 in zip(times["a"], times["a2"], strict=True)]
        out["control"] = {"speedup": statistics.median(ratios), **_spread(ratios)}
        out["resolved"] = speedup_resolved(out["speedup_iqr"], out["control"]["speedup_iqr"], repeats)
    return out


def _spread(ratios: list[float]) -> dict:
    if len(ratios) > 1:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        q1 = q3 = ratios[0]
    return {"speedup_iqr": [q1, q3], "speedup_range": [min(ratios), max(ratios)]}


# Quartiles of fewer timings say nothing about the spread.
MIN_RESOLVED_REPEATS = 5


def speedup_resolved(speedup_iqr: list[float], control_iqr: list[float], repeats: int) -> bool:
    """Whether a measured speed-up is outside the timing noise.

    True when there are at least ``MIN_RESOLVED_REPEATS`` repetitions and the interquartile
    range of the per-repetition speed-ups lies wholly above or below that of the A/A control
    (the same model timed against itself in the same loop).
    """
    if repeats < MIN_RESOLVED_REPEATS:
        return False
    return speedup_iqr[0] > control_iqr[1] or speedup_iqr[1] < control_iqr[0]


def speedup_fields(result: dict) -> dict:
    """What a run records about a :func:`compare_speed` result next to model b's own timings."""
    keys = ("speedup_iqr", "speedup_range", "control", "resolved")
    return {"speedup_vs_baseline": result["speedup"], **{k: result[k] for k in keys if k in result}}
