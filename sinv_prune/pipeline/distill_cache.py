"""Distillation from a cached teacher: its top-k log-probabilities, computed once per run (``distill.cache_top_k``).

What is stored, per position ``t`` of every fine-tune block (causal LMs): the ids ``S_t`` of the
teacher's ``k`` largest logits (int32) and their log-probabilities at temperature ``T`` over the **full**
vocabulary, ``v_t,i = log_softmax(z_teacher / T)_i`` for ``i`` in ``S_t`` (float16 or float32). Files:
``values.npy`` ``[blocks, seq_len, k]``, ``ids.npy`` (same shape) and ``meta.json`` (written last) in
``distill_cache/KEY/`` under the run directory, memory-mapped when read; ``6 * k`` bytes a token in
float16 (64: 384 bytes; 2M tokens: 0.77 GB).

The KL of an arm's step is the KL between teacher and student over ``k + 1`` outcomes: the teacher's
top-k tokens one by one, and the rest of the vocabulary as one::

    p_t,i     = exp(v_t,i),  i in S_t;   p_t,rest = 1 - sum_{i in S_t} p_t,i    teacher (full-vocabulary values)
    log q_t,i = log_softmax(z_student / T)_i,  i in S_t;   q_t,rest = its mass outside S_t
    KL_k      = mean over labelled t of  sum_{i in S_t} p_t,i (log p_t,i - log q_t,i)
                                         + p_t,rest (log p_t,rest - log q_t,rest)

``0 <= KL_k <= KL`` (merging outcomes never raises a KL), it is zero, with a zero gradient, where the
student is the teacher, and with ``k`` equal to the vocabulary size it is exactly
:func:`~sinv_prune.pipeline.distill.distillation_kl` (the test checks it to 1e-5 in float32; float16
values round at about 1e-3 relative). The loss is then the live one's,
``alpha * T**2 * KL_k + (1 - alpha) * LM loss``.

An earlier form renormalised the teacher over its top-k and left the rest out: that KL is
smallest where the student puts *all* its mass on the teacher's top-k, so it pulled even a student that
was the teacher away from it (a self-distilled SmolLM2 lost perplexity: docs/benchmarks.md section 15).

KEY is a hash of everything a row depends on: the teacher (its config and a strided sample of every
weight), the blocks' token ids, ``seq_len``, ``k``, ``T``, the stored dtype and the teacher's compute dtype;
a change of any of them builds a new cache. Rows are looked up by the ``index`` each batch carries
(:class:`sinv_prune.pipeline.data_stream.Blocks`); the cache holds the first blocks the budget needs, and
the fine-tune draws only those (shuffled unless ``shuffle: false``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from sinv_prune.strict_json import dumps

logger = logging.getLogger("sinv_prune")
CACHE_VERSION = 1
#: Below this mean top-k share of the teacher's probability (at ``T``) the cache build warns. Measured on
#: SmolLM2 (docs/benchmarks.md section 15): a top-64 cache holding 26% (T 2) barely moved a pruned model,
#: one holding 85% (T 1, the whole of valid.txt) recovered as far as the live teacher; the line sits between.
LOW_COVERAGE = 0.75
#: Elements of each weight tensor hashed into the teacher's fingerprint.
FINGERPRINT_SAMPLES = 4096


def topk_kl(
    student_logits: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    causal: bool = True,
) -> torch.Tensor:
    """``KL_k`` of the module docstring: mean over labelled positions, float32, no ``T**2``.

    ``values`` / ``ids``: ``[batch, seq_len, k]`` cached teacher log-probabilities (over the full vocabulary)
    and their token ids; positions count as in :func:`~sinv_prune.pipeline.distill.distillation_kl`.
    """
    if values.shape[:2] != student_logits.shape[:2]:
        raise ValueError(
            f"cached teacher rows {tuple(values.shape)} do not match the batch {tuple(student_logits.shape)}"
        )
    if causal:
        student_logits, values, ids, labels = student_logits[:, :-1], values[:, :-1], ids[:, :-1], labels[:, 1:]
    keep = labels != -100
    support = ids[keep].long()
    log_q_all = F.log_softmax(student_logits[keep].float() / temperature, dim=-1)
    log_q = log_q_all.gather(-1, support)
    log_p = values[keep].float()
    total = (log_p.exp() * (log_p - log_q)).sum()
    if support.shape[-1] < log_q_all.shape[-1]:  # the rest of the vocabulary, as one outcome
        p_rest = (1 - log_p.exp().sum(-1)).clamp(min=0)  # float16 rounding can take the sum past 1
        log_q_rest = torch.logsumexp(log_q_all.scatter(-1, support, float("-inf")), dim=-1)
        total = total + (torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest).sum()
    return total / keep.sum().clamp(min=1)


def teacher_fingerprint(model) -> str:
    """A hash of the teacher's config and a strided sample (``FINGERPRINT_SAMPLES`` values) of every weight.

    The config's ``_name_or_path`` (where it was loaded from) is left out: the same teacher read from another
    run directory keeps its key, so a copied or moved cache is reused.
    """
    config = {key: value for key, value in model.config.to_dict().items() if key != "_name_or_path"}
    digest = hashlib.sha256(dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        sample = flat[::step].to("cpu", torch.float32).numpy()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()


def cache_key(teacher, blocks, *, k: int, temperature: float, dtype: str, compute_dtype) -> str:
    """The cache directory's name (see the module docstring)."""
    data = hashlib.sha256(np.ascontiguousarray(np.asarray(blocks, dtype=np.int32)).tobytes()).hexdigest()
    key = {
        "version": CACHE_VERSION,
        "teacher": teacher_fingerprint(teacher),
        "data": data,
        "shape": list(np.shape(blocks)),
        "k": k,
        "temperature": float(temperature),
        "dtype": dtype,
        "compute_dtype": str(compute_dtype),
    }
    return hashlib.sha256(dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class TeacherCache:
    """A built cache (``values.npy``, ``ids.npy``), memory-mapped; :meth:`rows` gives a batch's rows."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.values = np.load(self.path / "values.npy", mmap_mode="r")
        self.ids = np.load(self.path / "ids.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.values)

    @property
    def coverage(self) -> float:
        """Mean share of the teacher's probability (at the cache's temperature) its top-k rows hold."""
        return float(self.meta.get("coverage", float("nan")))  # nan: a cache built before it was recorded

    def rows(self, index: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached ``(values, ids)`` of the blocks ``index`` (a batch's ``index`` column), on ``device``."""
        where = np.asarray(index.detach().cpu(), dtype=np.int64).reshape(-1)
        if where.size and (where.min() < 0 or where.max() >= len(self)):
            raise IndexError(f"block {int(where.max())} is not in the teacher cache ({len(self)} blocks): {self.path}")
        values = torch.from_numpy(np.ascontiguousarray(self.values[where])).to(device)
        ids = torch.from_numpy(np.ascontiguousarray(self.ids[where])).to(device)
        return values, ids


@torch.no_grad()
def build_cache(
    teacher,
    blocks,
    directory: Path,
    *,
    k: int,
    temperature: float,
    dtype: str = "float16",
    batch_size: int = 8,
    device=None,
    progress: bool = False,
) -> TeacherCache:
    """The teacher's top-k rows over ``blocks`` (``[n, seq_len]`` token ids), built once into ``directory/KEY``.

    The teacher runs in eval mode, ``batch_size`` blocks at a time on ``device`` (default: where it is);
    a cache with the same key is reused as it is.
    """
    from sinv_prune.progress import bar
    from sinv_prune.rundir import write_dir

    teacher = teacher.eval()
    param = next(teacher.parameters())
    device = torch.device(device) if device is not None else param.device
    vocab = teacher.get_output_embeddings().weight.shape[0]
    if not 0 < k <= vocab:
        raise ValueError(f"distill.cache_top_k: {k} is not in 1..{vocab} (the vocabulary)")
    key = cache_key(teacher, blocks, k=k, temperature=temperature, dtype=dtype, compute_dtype=param.dtype)
    target = Path(directory) / key
    if (target / "meta.json").is_file():
        logger.info("distillation cache: reusing %s", target)
        return report_coverage(TeacherCache(target), k, temperature)
    n, seq_len = np.shape(blocks)

    def write(d: Path) -> None:
        values = np.lib.format.open_memmap(d / "values.npy", mode="w+", dtype=np.dtype(dtype), shape=(n, seq_len, k))
        ids = np.lib.format.open_memmap(d / "ids.npy", mode="w+", dtype=np.int32, shape=(n, seq_len, k))
        starts = range(0, n, batch_size)
        mass = 0.0
        for start in bar(starts, desc="teacher cache", unit="batch", disable=not progress):
            chunk = torch.as_tensor(np.array(blocks[start : start + batch_size]), dtype=torch.long, device=device)
            logits = teacher(input_ids=chunk).logits.float()
            top, where = F.log_softmax(logits / temperature, dim=-1).topk(k, dim=-1)
            mass += top.exp().sum(-1).sum().item()
            values[start : start + len(chunk)] = top.cpu().numpy().astype(dtype)
            ids[start : start + len(chunk)] = where.cpu().numpy().astype(np.int32)
        values.flush()
        ids.flush()
        del values, ids
        meta = {"version": CACHE_VERSION, "blocks": int(n), "seq_len": int(seq_len), "k": k,
                "temperature": float(temperature), "dtype": dtype, "vocab": int(vocab),
                "coverage": mass / max(1, n * seq_len)}  # fmt: skip
        (d / "meta.json").write_text(dumps(meta))

    write_dir(target, write)
    cache = TeacherCache(target)
    logger.info("distillation cache: top-%d of %d blocks x %d tokens -> %s", k, n, seq_len, target)
    return report_coverage(cache, k, temperature)


def report_coverage(cache: TeacherCache, k: int, temperature: float) -> TeacherCache:
    """Log the share of the teacher's probability the cached top-k rows hold; warn below ``LOW_COVERAGE``.

    Built and reused caches alike, so a rerun that reuses a thin cache still says so.
    """
    if cache.coverage != cache.coverage:  # nan
        logger.info("distillation cache: built before coverage was recorded; rebuild it to know its share")
        return cache
    logger.info("distillation cache: the top %d hold %.0f%% of the teacher's probability at T %g",
                k, 100 * cache.coverage, temperature)  # fmt: skip
    if cache.coverage < LOW_COVERAGE:
        logger.warning(
            "distill.cache_top_k: the teacher's top %d tokens hold only %.0f%% of its probability at temperature %g "
            "(mean over the cached tokens); the other %.0f%% is one outcome of the KL, so the student sees little "
            "of the teacher's tail and recovers slowly: raise cache_top_k, lower temperature, or drop cache_top_k "
            "for the live teacher (docs/benchmarks.md section 15)", k, 100 * cache.coverage, temperature,
            100 * (1 - cache.coverage))  # fmt: skip
    return cache


def run_cache(run, blocks, load_teacher) -> TeacherCache:
    """The run's cache over the blocks the arms will read (built by the main process, opened by every one).

    The arms draw the first ``steps * tokens_per_step / seq_len`` blocks (every block when the epochs decide
    or the budget exceeds them), in the order ``finetune.shuffle`` says. ``load_teacher()`` is called only
    when the cache must be built; the teacher is released before any arm trains.
    """
    from sinv_prune.pipeline.step_budget import planned_steps

    spec, seq, world = run.recipe.finetune, run.recipe.data.seq_len, run.ranks.world_size
    steps = planned_steps(spec, seq, world)
    needed = len(blocks) if steps is None else steps * spec.batch_size * spec.gradient_accumulation_steps * world
    rows = blocks.blocks[: min(len(blocks), needed)]
    distill = spec.distill

    def build() -> Path:
        teacher = load_teacher()
        cache = build_cache(teacher, rows, run.root / "distill_cache", k=distill.cache_top_k,
                            temperature=distill.temperature, dtype=distill.cache_dtype,
                            batch_size=run.recipe.evaluate.window_batch_size, device=run.device,
                            progress=not run.quiet)  # fmt: skip
        return cache.path

    return TeacherCache(run.ranks.on_main(build))
