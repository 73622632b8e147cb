"""Expert criteria on a small MoE trained here: every criterion x {25%, 50%} of the experts, one-shot and fine-tuned.

Runs ``recipes/moe-quickstart.yaml`` (a small Qwen3-MoE trained from scratch on WikiText-2 valid.txt,
evaluated on test.txt: the train split is not on this machine) into ``--run`` unless that directory already
holds a finished run of it, then reads its results and measures, in this one process and interleaved with
the unpruned model, each arm's forward time and peak memory (process RSS above the level before the
forward, sampled every 5 ms) as ratios to the unpruned model's. Prints one table (parameters, test
perplexity and last-word accuracy one-shot and after the recipe's fine-tune, forward time and peak memory
ratios) and checks the issue's targets: the best criterion at 25% within 1.10x the unpruned perplexity
one-shot; ``reap`` and ``frequency`` ahead of ``random`` at both cuts.

    python scripts/bench_experts.py --run runs/moe-quickstart --json bench_experts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
from _bench_setup import PeakMemory  # noqa: E402

import sinv_prune  # noqa: E402
from sinv_prune.lmeval.harness import headline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "moe-quickstart.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=Path("runs/moe-quickstart"), help="the recipe's run directory")
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    ap.add_argument("--repeats", type=int, default=10, help="interleaved forwards per model for the time ratio")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if common.wikitext_file("test") is None:
        print("WikiText-2 is not in ../shared/data/wikitext-2: nothing to measure")
        return 0
    common.set_threads(args.threads)
    results_path = args.run / "results.json"
    started = time.perf_counter()
    if not results_path.is_file():
        command = [sys.executable, "-m", "sinv_prune.cli", str(args.recipe), "--output", str(args.run)]
        print("running", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    recipe_seconds = time.perf_counter() - started
    results = json.loads(results_path.read_text())
    base_dir = args.run / "base"
    base = sinv_prune.from_pretrained(base_dir).eval()
    inputs = {"input_ids": torch.randint(0, base.config.vocab_size, (args.batch_size, args.seq_len))}
    base_row = results["baseline"]
    rows = []
    for arm in results["arms"]:
        row = {"arm": arm["name"], "criterion": "+".join(arm["criterion"]) if isinstance(arm["criterion"], list)
               else arm["criterion"], "experts_removed": arm.get("experts_removed", 0)}  # fmt: skip
        for stage in ("pruned", "finetuned"):
            measured = arm.get(stage)
            if measured is None:
                continue
            row[f"{stage} ppl"] = measured["perplexity"]
            row[f"{stage} ppl x"] = measured["perplexity"] / base_row["perplexity"]
            row[f"{stage} lastword"] = _lastword(measured)
        row["params x"] = arm["params"] / base_row["params"]
        model = sinv_prune.from_pretrained(args.run / arm["model_dir"]).eval()
        row["forward x"], row["peak memory x"] = _ratios(base, model, inputs, args.repeats)
        rows.append(row)
        del model
    base_lastword = _lastword(base_row)
    print(f"unpruned: {base_row['params']:,} parameters, test perplexity {base_row['perplexity']:.2f}, "
          f"last-word accuracy {_fmt(base_lastword)}")  # fmt: skip
    headers = ["arm", "experts removed", "params x", "ppl one-shot (x)", "last-word one-shot", "ppl fine-tuned (x)",
               "last-word fine-tuned", "forward x", "peak memory x"]  # fmt: skip
    table = [
        [r["arm"], r["experts_removed"], f"{r['params x']:.3f}",
         f"{r.get('pruned ppl', float('nan')):.2f} ({r.get('pruned ppl x', float('nan')):.3f})",
         _fmt(r.get("pruned lastword")),
         f"{r.get('finetuned ppl', float('nan')):.2f} ({r.get('finetuned ppl x', float('nan')):.3f})",
         _fmt(r.get("finetuned lastword")), f"{r['forward x']:.3f}", f"{r['peak memory x']:.3f}"]
        for r in rows
    ]  # fmt: skip
    print(common.table(headers, table))
    checks = _targets(rows)
    for line in checks:
        print(line)
    if args.json:
        common.write_json(args.json, {"baseline": base_row, "rows": rows, "checks": checks,
                                      "recipe_seconds": recipe_seconds, "machine": common.machine()})  # fmt: skip
    return 0


def _lastword(measured: dict) -> float | None:
    task = (measured.get("tasks") or {}).get("wikitext_lastword")
    shown = headline(task) if task else None
    return None if shown is None else shown[1]


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratios(base, model, inputs, repeats: int) -> tuple[float, float]:
    """Median of interleaved forward-time ratios, and the ratio of peak memory above the level before each forward."""
    times = {"base": [], "arm": []}
    peaks = {"base": [], "arm": []}
    with torch.no_grad():
        for m in (base, model):  # warm-up
            m(**inputs)
        for _ in range(repeats):
            for name, m in (("base", base), ("arm", model)):
                with PeakMemory("cpu") as mem:
                    start = time.perf_counter()
                    m(**inputs)
                    times[name].append(time.perf_counter() - start)
                peaks[name].append(mem.added)
    ratio = statistics.median(a / b for a, b in zip(times["arm"], times["base"], strict=True))
    return ratio, statistics.median(peaks["arm"]) / max(statistics.median(peaks["base"]), 1)


def _targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each as a line that says whether it holds and by how much."""
    lines = []
    by_cut: dict[str, dict[str, dict]] = {}
    for r in rows:
        cut = r["arm"].split("-")[-2] if "-" in r["arm"] else r["arm"]
        by_cut.setdefault(cut, {})[r["criterion"]] = r
    for cut, arms in sorted(by_cut.items()):
        best = min(arms.values(), key=lambda r: r.get("pruned ppl x", float("inf")))
        lines.append(f"cut {cut}: best one-shot {best['criterion']} at {best.get('pruned ppl x', float('nan')):.3f}x "
                     "the unpruned perplexity")  # fmt: skip
        control = arms.get("random")
        for name in ("reap", "frequency"):
            if control is None or name not in arms:
                continue
            for stage in ("pruned", "finetuned"):
                ours, theirs = arms[name].get(f"{stage} ppl"), control.get(f"{stage} ppl")
                if ours is None or theirs is None:
                    continue
                verdict = "beats" if ours < theirs else "does NOT beat"
                lines.append(f"cut {cut} {stage}: {name} {verdict} random ({ours:.2f} vs {theirs:.2f})")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
