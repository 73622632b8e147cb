"""Peak host memory of ``prune(..., compensate=...)`` beyond the model, on random LLaMA shapes of one width.

Each run is a fresh process: it builds a random LLaMA (float32, CPU), warms up with one forward, reads
its resident set size (RSS: model, calibration tokens, libraries), then prunes a quarter of every
layer's heads and a sixteenth of its MLP channels with compensation while a thread samples the RSS every 10 ms.
Overhead = peak RSS during ``prune`` minus the RSS just before it: the sampled peak, and the
kernel's peak (``ru_maxrss``; it also counts any higher peak before ``prune``). ``--store`` is passed only where
``prune`` takes it (older code does not), so the same script measures before and after.

    python scripts/measure_prune_memory.py --layers 4 16 --store cpu disk
    MALLOC_MMAP_THRESHOLD_=131072 python scripts/measure_prune_memory.py --layers 4 16 --store cpu disk

glibc raises its mmap threshold when large blocks are freed, and from then on keeps freed memory in
its heap: RSS then grows with what was ever allocated, not only with what is alive. A fixed
``MALLOC_MMAP_THRESHOLD_`` (second line) turns that off, so the overhead counts live memory more closely.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def one(
    layers: int, store: str | None, method: str, hidden: int, intermediate: int, seqs: int, tokens: int, threads: int
) -> dict:
    import torch
    import transformers

    import sinv_prune

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    heads = hidden // 32
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    calibration = [{"input_ids": torch.randint(3, 1024, (1, tokens), generator=g)} for _ in range(seqs)]
    with torch.no_grad():
        model(**calibration[0])
    plan = {
        "heads": {i: list(range(0, heads, 4)) for i in range(layers)},
        "mlp": {i: list(range(0, intermediate, 16)) for i in range(layers)},
    }
    kwargs = {"store": store} if store and "store" in inspect.signature(sinv_prune.prune).parameters else {}
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = rss()
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    summary = sinv_prune.prune(model, plan, calibration=calibration, compensate=method, **kwargs)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    peak[0] = max(peak[0], rss())
    return {
        "layers": layers, "store": kwargs.get("store", "(none)"), "method": method, "code": sinv_prune.__file__,
        "model_mib": round(model_bytes / 2**20, 1), "overhead_mib": round((peak[0] - before) / 2**20, 1),
        "overhead_maxrss_mib": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / 2**20, 1),
        "seconds": round(seconds, 1), "kept": summary.compensation.kept,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--store", nargs="+", default=["cpu", "disk"])
    parser.add_argument("--method", default="obs", choices=["obs", "lsq", "bias"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        shape = (args.hidden, args.intermediate, args.sequences, args.tokens, args.threads)
        print(json.dumps(one(args.layers[0], args.store[0], args.method, *shape)))
        return
    for store in args.store:
        for layers in args.layers:
            command = [sys.executable, __file__, "--one", "--layers", str(layers), "--store", store,
                       "--method", args.method, "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
                       "--sequences", str(args.sequences), "--tokens", str(args.tokens),
                       "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(json.dumps({"layers": layers, "store": store, "error": done.stderr.strip()[-2000:]}), flush=True)
                continue
            print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
