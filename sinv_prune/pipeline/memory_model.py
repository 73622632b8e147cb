"""Peak memory of a pruning run, predicted from the model's config before anything is loaded (``--dry-run``).

A run keeps, at its peak, the model where it lives, plus what its calibration pass holds. This module adds
those terms up from the shapes alone (the model is built on the ``meta`` device: no weight is read), for
the designs of :mod:`sinv_prune.surgery.layerwise` (``layerwise=True``, the default) and of a whole-model
pass with every layer's statistics on the weights' device (``layerwise=False``: the code before issue 34).

Terms, in bytes (``a``: the model dtype's bytes, ``s``: the statistics dtype's, ``T``: calibration tokens,
``h``: hidden width, per consumer ``in`` x ``out``: ``o_proj`` (in = heads x head_dim) and a dense layer's
down projection (in = intermediate); ``L`` layers):

* ``model``: every parameter and buffer. With ``offload="none"`` on the compute device; ``"cpu"``: on the host
  with one block (the largest) on the device; ``"disk"``: one block on the host (being read) and one on the
  device, the embeddings and head on the host.
* ``statistics`` (shrink): ``2 x s x sum_c ((in+b)^2 + (in+b) out)`` per layer (``b`` 1 where the consumer
  has a bias; fit and held-out Grams and cross products), kept for every layer: on the host (layer-wise; on
  disk with ``offload="disk"``, one layer in memory) or on the weights' device (whole-model, float64).
  Compensation holds one layer's at a time.
* ``solve``: an OBS / refit solve on the widest consumer: 3 float64 ``in x in`` matrices (Gram, its factor,
  the inverse) on the device.
* ``hidden``: the calibration hidden states on the host, ``copies x T x h x a`` (2 for statistics and criteria:
  a block's inputs and outputs; 3 for compensation: teacher, student and the targets).
* ``activations``: one batch through one block on the device: ``b x length x (6h + 3 I_active) x 4`` with
  ``I_active`` the dense intermediate width or ``top_k x`` the expert width (a routing criterion recomputes the
  routed experts' outputs in float32: ``+ b x length x top_k x (2 I_e + h) x 4``), plus a candidate's logits
  for shrink's fitness (``2 x fitness tokens x vocab x 4``, the reference and the candidate).
* ``runtime``: :data:`RUNTIME_BYTES` on the host.
* ``removal``: :func:`~sinv_prune.prune` writes the cut blocks' new weights and holds the old ones until it
  returns (to undo a failed call): every block's size, an upper bound (a cut keeps less), where the model is;
  shrink with its store on disk (``store="disk"``, the default with ``offload="disk"``) holds one block's.
* ``weights kept``: what grows with depth by design: shrink's candidate refit weights (``sum over layers and
  consumers of in x out x a``) plus its refit cache (as much again, at most
  :data:`~sinv_prune.shrink.statistics.REFIT_CACHE_BYTES`; none in memory with its store on disk: files), and
  compensation's undo copies (``1 x``).

With the compute device the CPU, device and host are one memory: the prediction's ``device`` is 0 and the
host holds everything. Constants are round numbers, not fitted; ``scripts/bench_memory.py`` prints the
prediction beside the measured peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
TASKS = ("shrink", "compensate", "criterion", "plain")
OFFLOADS = ("none", "cpu", "disk")
GIB = 1 << 30
#: What a run's process adds whatever the model: kernels' first use, lazily imported modules, allocator pools.
#: ``scripts/bench_memory.py --quick`` (hidden 64) measured 29-46 MiB here; this is the round middle.
RUNTIME_BYTES = 40 << 20


@dataclass
class Shape:
    """What the memory model reads of a model: sizes per block and of its consumers."""

    layers: int
    hidden: int
    vocab: int
    model_bytes: int
    block_bytes: list[int]  # per block: its parameters and buffers
    consumers: list[list[tuple[int, int, bool]]]  # per layer: (in, out, has a bias) of o_proj and a dense down proj
    intermediate: list[int]  # per layer: the dense MLP width (0 on MoE layers)
    experts: list[tuple[int, int, int]]  # per layer: (routed experts, expert width, top_k); (0, 0, 0) dense
    dtype_bytes: int

    @property
    def outside_blocks(self) -> int:
        """Embeddings, final norm and head."""
        return self.model_bytes - sum(self.block_bytes)


def shape_of(config, cls=None, dtype: str | torch.dtype | None = None) -> Shape:
    """The :class:`Shape` of ``config``'s model (``cls`` default: ``AutoModelForCausalLM``'s) in ``dtype``
    (default: the config's own, float32 where it names none), built on the ``meta`` device."""
    import transformers

    dtype = _dtype(dtype if dtype is not None else config_dtype(config))
    cls = cls or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    model.to(dtype)
    return shape_of_model(model, dtype_bytes=torch.tensor([], dtype=dtype).element_size())


def config_dtype(config) -> str:
    """The dtype a checkpoint loads in (its config's ``dtype`` / ``torch_dtype``; float32 where it names none)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(value).removeprefix("torch.")


def shape_of_source(source: str, gguf_file: str | None = None, dtype: str | None = None) -> Shape:
    """The :class:`Shape` of the checkpoint at ``source`` (a directory, Hub id or GGUF file), from its config
    alone, in the class and dtype :func:`sinv_prune.from_pretrained` would load it (GGUF: float32)."""
    from transformers import AutoConfig

    from sinv_prune.surgery.checkpoint import model_class, pruned_class
    from sinv_prune.surgery.record import get_record

    if source.endswith(".gguf") and os.path.isfile(source):
        source, gguf_file = os.path.split(os.path.abspath(source))
    config = AutoConfig.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
    record = get_record(config)
    cls = model_class(config, record, gguf=bool(gguf_file))
    if record is not None and not record.stock_layout:
        cls = pruned_class(cls)
    return shape_of(config, cls, dtype or ("float32" if gguf_file else config_dtype(config)))


def shape_of_model(model, dtype_bytes: int | None = None) -> Shape:
    """The :class:`Shape` of a built model (real or on ``meta``)."""
    from sinv_prune.arch import get_adapter
    from sinv_prune.scoring.consumer_statistics import consumer_modules
    from sinv_prune.surgery.refit import consumer_weights

    adapter = get_adapter(model)
    n = adapter.num_layers
    first = next(model.parameters())
    a = dtype_bytes or first.element_size()

    def size(module) -> int:
        return sum(t.numel() for t in (*module.parameters(), *module.buffers())) * a

    consumers: list[list[tuple[int, int, bool]]] = [[] for _ in range(n)]
    for (_, layer), module in consumer_modules(adapter).items():
        weight, bias = consumer_weights(module)
        consumers[layer].append((weight.shape[1], weight.shape[0], bias is not None))
    experts, intermediate = [], []
    for i in range(n):
        count = adapter.num_experts(i)
        if count:
            experts.append((count, int(adapter.expert_width(i)), int(adapter.top_k())))
            intermediate.append(0)
        else:
            experts.append((0, 0, 0))
            intermediate.append(int(adapter.intermediate_size(i)))
    hidden = int(model.config.hidden_size)
    vocab = model.get_input_embeddings().num_embeddings
    return Shape(layers=n, hidden=hidden, vocab=vocab, model_bytes=size(model),
                 block_bytes=[size(b) for b in adapter.layers()], consumers=consumers, intermediate=intermediate,
                 experts=experts, dtype_bytes=a)  # fmt: skip


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name == "auto":
        name = "float32"
    return getattr(torch, name)


@dataclass
class Prediction:
    """Predicted peaks (bytes) and the terms they add up from."""

    task: str
    device: str
    offload: str
    model_bytes: int
    device_peak: int  # on the compute device (0 where it is the CPU: the host holds everything)
    host_peak: int
    device_terms: dict[str, int] = field(default_factory=dict)
    host_terms: dict[str, int] = field(default_factory=dict)
    disk_bytes: int = 0

    @property
    def on_cpu(self) -> bool:
        return not self.device.startswith("cuda")

    @property
    def device_overhead(self) -> int:
        """Peak beyond the model's own size, where the model would otherwise be."""
        if self.on_cpu:
            return self.host_peak - self.model_bytes
        return self.device_peak - (self.model_bytes if self.offload == "none" else 0)

    @property
    def host_overhead(self) -> int:
        held = self.model_bytes if self.on_cpu or self.offload == "cpu" else 0
        return self.host_peak - held

    def lines(self) -> list[str]:
        """``--dry-run``'s lines: the peaks and their main terms."""

        def terms(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {gib(v)}" for k, v in d.items() if v)

        out = []
        if not self.on_cpu:
            out.append(f"predicted peak memory on {self.device}: {gib(self.device_peak)} ({terms(self.device_terms)})")
        out.append(f"predicted peak host memory: {gib(self.host_peak)} ({terms(self.host_terms)})")
        if self.disk_bytes:
            out.append(f"offloaded to disk: {gib(self.disk_bytes)}")
        return out


def gib(x: int) -> str:
    """Bytes as GiB (2 decimals) from 1 GiB up, else MiB (1 decimal)."""
    return f"{x / GIB:.2f} GiB" if abs(x) >= GIB else f"{x / (1 << 20):.1f} MiB"


def predict(
    shape: Shape,
    task: str,
    *,
    sequences: int,
    length: int,
    device: str = "cpu",
    offload: str = "none",
    stat_dtype: str = "float32",
    batch: int = 1,
    fitness_tokens: int = 1024,
    layerwise: bool = True,
    kept_share: float = 1.0,
    store: str | None = None,
    refine: bool = False,
) -> Prediction:
    """Peak device and host memory of ``task`` (:data:`TASKS`: ``shrink``; ``compensate``, OBS / lsq refits at
    prune time; ``criterion``, a calibration-reading criterion; ``plain``, a removal without calibration) on
    ``shape`` with ``sequences`` x ``length`` calibration tokens, batches of ``batch`` sequences (shrink: 4).
    ``fitness_tokens``: shrink's fitness batch (sequences x tokens); ``kept_share``: of the blocks' weights the cut
    keeps, where known (1: the upper bound). ``store``: shrink's (default ``"disk"`` with ``offload="disk"``,
    else ``"cpu"``); on disk, its statistics, refits and rollback copies are files, one at a time in memory.
    ``refine``: shrink's sequential build besides (a copy of the model and the compensation's three hidden
    streams; no offload)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: one of {', '.join(TASKS)}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload {offload!r}: one of {', '.join(OFFLOADS)}")
    a, h, n = shape.dtype_bytes, shape.hidden, shape.layers
    s = DTYPE_BYTES[stat_dtype] if layerwise else 8
    tokens = sequences * length
    if task == "shrink":
        batch = max(batch, 4)
    widest = max((i for layer in shape.consumers for i, _, _ in layer), default=0)

    def layer_stats(layer: int) -> int:  # fit and held-out: Gram [X 1]^T [X 1] and cross [X 1]^T Y
        return 2 * s * sum((i + b) ** 2 + (i + b) * o for i, o, b in shape.consumers[layer])

    stats_all = sum(layer_stats(i) for i in range(n))
    stats_one = max((layer_stats(i) for i in range(n)), default=0)
    consumer_weights = sum(i * o for layer in shape.consumers for i, o, _ in layer) * a
    active = max(
        max(shape.intermediate, default=0),
        max((k * w for _, w, k in shape.experts), default=0),
    )
    rows = batch * length
    activations = rows * (6 * h + 3 * active) * 4
    if task in ("criterion", "shrink") and any(e for e, _, _ in shape.experts):
        activations += rows * max(k * (2 * w + h) for _, w, k in shape.experts) * 4
    if task == "plain":
        activations = 0
    solve = 3 * 8 * (widest + 1) ** 2 if task in ("shrink", "compensate") else 0
    logits = 2 * fitness_tokens * shape.vocab * 4 if task == "shrink" else 0
    copies = {"shrink": 2, "criterion": 2, "compensate": 3, "plain": 0}[task]
    hidden = copies * tokens * h * a
    from sinv_prune.shrink.statistics import REFIT_CACHE_BYTES

    store = store or ("disk" if offload == "disk" else "cpu")
    on_disk = task == "shrink" and layerwise and store == "disk"
    shrink_kept = consumer_weights + min(consumer_weights, REFIT_CACHE_BYTES)
    kept = {"shrink": 0 if on_disk else shrink_kept, "compensate": consumer_weights}.get(task, 0)
    # prune() replaces the cut blocks' weights and keeps the old ones until it returns (to undo a failed call):
    # the new weights of every block, an upper bound (a cut keeps less)
    block = max(shape.block_bytes, default=0)
    removal = int(kept_share * (block if on_disk else sum(shape.block_bytes)))

    device_terms: dict[str, int] = {}
    host_terms: dict[str, int] = {}
    disk = 0
    if offload == "none":
        device_terms["model"] = shape.model_bytes
    else:
        device_terms["one block"] = block + shape.outside_blocks
        if offload == "cpu":
            host_terms["model"] = shape.model_bytes
        else:
            host_terms["one block, embeddings"] = block + shape.outside_blocks
            disk = shape.model_bytes
    stats_where = device_terms if not layerwise else host_terms
    if task == "shrink":
        if on_disk:
            stats_where["statistics (one layer)"] = stats_one
            disk += stats_all
        else:
            stats_where["statistics"] = stats_all
        if layerwise:
            device_terms["statistics (one layer)"] = stats_one
    elif task == "compensate":
        device_terms["statistics (one layer)"] = stats_one
    host_terms["runtime"] = RUNTIME_BYTES
    if layerwise:
        host_terms["hidden states"] = hidden
    else:
        device_terms["hidden states"] = hidden
    device_terms["activations"] = activations + logits
    device_terms["solve"] = solve
    device_terms["weights kept"] = kept
    if task == "shrink" and refine:
        device_terms["refine: a copy of the model"] = shape.model_bytes
        device_terms["refine: hidden states"] = 3 * tokens * h * a
    (device_terms if offload == "none" else host_terms)["removal"] = removal
    on_cpu = not str(device).startswith("cuda")
    if on_cpu:  # one memory
        if task == "shrink" and layerwise:  # the layer's statistics are accumulated where they are kept
            device_terms.pop("statistics (one layer)", None)
        for k, v in device_terms.items():
            host_terms[k] = host_terms.get(k, 0) + v
        if offload != "none":  # the block "on the device" is the host's own copy
            host_terms.pop("one block", None)
        device_terms = {}
    return Prediction(task=task, device=str(device), offload=offload, model_bytes=shape.model_bytes,
                      device_peak=sum(device_terms.values()), host_peak=sum(host_terms.values()),
                      device_terms=device_terms, host_terms=host_terms, disk_bytes=disk)  # fmt: skip


# -- what fits ------------------------------------------------------------------------------------


def available_memory(device: str) -> tuple[int | None, int | None]:
    """``(free bytes on the compute device or None on the CPU, available host bytes or None if unknown)``."""
    host = _host_available()
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), host
    return None, host


def _host_available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fits(pred: Prediction, device_free: int | None, host_free: int | None) -> bool:
    if device_free is not None and not pred.on_cpu and pred.device_peak > device_free:
        return False
    return host_free is None or pred.host_peak <= host_free


def refusal(shape: Shape, task: str, device_free: int | None, host_free: int | None, *,
            sequences_option: str = "--sequences {} or fewer", offload_option: str | None = "--offload {}",
            **options) -> str | None:  # fmt: skip
    """``None`` where the run fits; else one line: the predicted peak, what is free, the option that would fit.

    ``options`` are :func:`predict`'s; the alternatives tried in order: ``--offload cpu``, ``--offload disk``,
    then fewer calibration sequences (halved down to 2; ``sequences_option`` says how, ``{}`` the count) with the
    last offload tried (``offload_option``: how the option is written, ``{}`` the mode; None where the command
    cannot offload: only fewer sequences are offered then).
    """
    pred = predict(shape, task, **options)
    if fits(pred, device_free, host_free):
        return None
    where, peak, free = (
        (pred.device, pred.device_peak, device_free)
        if not pred.on_cpu and device_free is not None and pred.device_peak > device_free
        else ("the host", pred.host_peak, host_free)
    )
    head = f"predicted peak memory {gib(peak)} on {where}, {gib(free or 0)} free"
    offload = options.get("offload", "none")
    can_offload = offload_option and not options.get("refine")  # shrink's refine copies the model: no offload
    tries = [o for o in OFFLOADS if OFFLOADS.index(o) > OFFLOADS.index(offload)] if can_offload else []
    for other in tries:
        alt = predict(shape, task, **{**options, "offload": other})
        if fits(alt, device_free, host_free):
            return f"{head}: use {offload_option.format(other)} (predicted {gib(_binding(alt))})"
    best = tries[-1] if tries else offload
    sequences = options["sequences"]
    while sequences > 2:
        sequences = max(2, sequences // 2)
        alt = predict(shape, task, **{**options, "offload": best, "sequences": sequences})
        if fits(alt, device_free, host_free):
            flag = f"{offload_option.format(best)} and " if best != offload else ""
            return f"{head}: use {flag}{sequences_option.format(sequences)} (predicted {gib(_binding(alt))})"
    return f"{head}: no offload or calibration size fits; use a device with more memory"


def _binding(pred: Prediction) -> int:
    return pred.host_peak if pred.on_cpu else pred.device_peak


def dry_run_check(shape: Shape, task: str, device: str, *, sequences_option: str = "--sequences {} or fewer",
                  offload_option: str | None = "--offload {}", **options) -> tuple[list[str], str | None]:  # fmt: skip
    """The dry run's lines and the refusal (or None), with the memory free now on ``device`` and the host."""
    pred = predict(shape, task, device=device, **options)
    device_free, host_free = available_memory(device)
    lines = pred.lines()
    free = [f"{gib(device_free)} free on {device}"] if device_free is not None else []
    if host_free is not None:
        free.append(f"{gib(host_free)} available on the host")
    if free:
        lines.append("memory now: " + ", ".join(free))
    return lines, refusal(shape, task, device_free, host_free, device=device, sequences_option=sequences_option,
                          offload_option=offload_option, **options)  # fmt: skip
