"""Recovery after head pruning on SmolLM2-135M: compensation, LM fine-tune, distillation, iterative pruning.

Two cuts of SmolLM2-135M's 270 query heads (30 layers x 9 query / 3 KV heads):

* ``10% global``: 27 heads, ``select_heads(mode="global", layout="q_per_group")`` (every KV group stays, so
  a layer loses a multiple of 3 query heads: one per KV group);
* ``uniform 33%``: 90 heads, ``select_heads(mode="uniform", layout="q_per_group")``: in every layer, the
  lowest-scored query head of each KV group.

Rows, each on a fresh copy of the unpruned model:

* one-shot: every criterion x compensation (``none``, ``lsq``; ``bias`` with ``add_bias=True``, since LLaMA's
  ``o_proj`` has no bias, in ``--quick``/``--full`` or with ``--compensations``): ``prune_heads(...,
  calibration=, compensate=)``, then test perplexity;
* for the criterion whose one-shot + lsq row is best in each cut: ``N`` steps of LM fine-tune, ``N`` steps of
  distillation (``alpha * T^2 * KL + (1 - alpha) * LM``, teacher the unpruned model), both through
  ``sinv_prune.pipeline.training.run_trainer`` (the recipes' Trainer path), and iterative pruning (3 rounds, each
  re-scoring the pruned model; with ``lsq`` each round's ``prune_heads`` compensates, so every round is
  refitted against the model as it was before that round). Each with and without lsq.
* references: the unpruned model (one-shot rows' ratio) and the unpruned model LM-fine-tuned the same ``N``
  steps on the same batches (fine-tuned and distilled rows' ratio); both cached per model, data and settings
  (``_bench_setup.Bench.reference``), so a rerun measures only the rows.

Data: calibration (for lsq / bias and for the data-driven criteria ``taylor`` and ``activation``) is the first
``--calib-batches`` x ``--calib-seq-len`` tokens of WikiText-2 valid.txt; fine-tune blocks are the valid.txt
tokens after them. Perplexity: ``sinv_prune.pipeline.evaluation.perplexity`` over the first ``--eval-tokens`` tokens of
test.txt in non-overlapping windows of ``--seq-len``. ``--quick`` uses a tiny random LLaMA (structure only).

    OMP_NUM_THREADS=2 python scripts/bench_recovery.py --threads 2 --plot docs/bench_recovery.png --json r.json
    python scripts/bench_recovery.py --quick          # seconds; tiny random LLaMA, tests the script only
    python scripts/bench_recovery.py --full --device cuda
    python scripts/bench_recovery.py --units          # heads vs MLP vs layers vs a mix at matched parameter cuts

``--units`` runs ``scripts/bench_units.py`` (its own options; ``--units --help``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars; read when tqdm is imported

import argparse  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
from _bench_setup import GLOBAL, OPTIONS, UNIFORM, Bench, acc_text, layer_weight_bytes, ppl, setup_bench  # noqa: E402

from sinv_prune import HeadPruner, count_parameters  # noqa: E402

ALL_CRITERIA = ("random", "magnitude", "taylor", "activation", "sinv_gauge")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--units", action="store_true", help="heads vs MLP vs layers at matched parameter cuts "
                    "(scripts/bench_units.py; its own options)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny random LLaMA, tiny budgets: tests the script only")
    ap.add_argument("--full", action="store_true", help="every criterion and compensation, longer runs (for a GPU)")
    ap.add_argument("--criteria", nargs="+", choices=ALL_CRITERIA, help="one-shot criteria")
    ap.add_argument("--compensations", nargs="+", choices=["none", "lsq", "bias"], help="one-shot compensations")
    ap.add_argument("--recovery-compensations", nargs="+", choices=["none", "lsq", "bias"],
                    help="compensations of the fine-tune / distill / iterative rows")  # fmt: skip
    ap.add_argument("--eval-tokens", type=int, help="test.txt tokens evaluated (default 16384; --full 65536)")
    ap.add_argument("--seq-len", type=int, help="perplexity window (default 512)")
    ap.add_argument("--lastword", type=int, help="wikitext_lastword items for the last-word accuracy column "
                    "(lm-eval; default 200, --quick 4, --full all 1403; 0: no column)")  # fmt: skip
    ap.add_argument("--calib-batches", type=int, help="calibration batches (default 16)")
    ap.add_argument("--calib-seq-len", type=int, help="tokens per calibration batch (default 512)")
    ap.add_argument("--score-batches", type=int, help="calibration batches taylor / activation score on (default 4)")
    ap.add_argument("--steps", type=int, help="fine-tune / distillation steps N (default 8)")
    ap.add_argument("--batch", type=int, help="blocks per fine-tune step (default 4)")
    ap.add_argument("--ft-seq-len", type=int, help="tokens per fine-tune block (default 256)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no decay, clip 1.0)")
    ap.add_argument("--temperature", type=float, default=2.0, help="distillation temperature (the recipe default)")
    ap.add_argument("--alpha", type=float, default=0.5, help="distillation weight of the KL term (the recipe default)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the iterative rows")
    ap.add_argument("--max-minutes", type=float, help="start no recovery row after this many minutes (default 40; "
                    "--quick / --full: no limit)")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, help="write the perplexity plot (PNG) here")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args(argv)
    if args.quick and args.full:
        ap.error("--quick and --full exclude each other")
    preset = {  # quick, default, full
        "eval_tokens": (256, 16384, 65536),
        "lastword": (4, 200, 1403),
        "seq_len": (64, 512, 512),
        "calib_batches": (2, 16, 32),
        "calib_seq_len": (32, 512, 512),
        "score_batches": (1, 4, 16),
        "steps": (1, 8, 100),
        "batch": (2, 4, 8),
        "ft_seq_len": (32, 256, 512),
        "criteria": (list(ALL_CRITERIA), ["taylor", "activation", "sinv_gauge"], list(ALL_CRITERIA)),
        "compensations": (["none", "lsq", "bias"], ["none", "lsq"], ["none", "lsq", "bias"]),
        "recovery_compensations": (["none", "lsq"], ["lsq"], ["none", "lsq", "bias"]),
        "max_minutes": (None, 40.0, None),
    }
    which = 0 if args.quick else 2 if args.full else 1
    for key, values in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, values[which])
    if args.score_batches > args.calib_batches:
        ap.error(f"--score-batches ({args.score_batches}) exceeds --calib-batches ({args.calib_batches})")
    return args


def over_budget(args, t_start: float) -> bool:
    return args.max_minutes is not None and time.perf_counter() - t_start > 60 * args.max_minutes


def row(cut, criterion, comp, recovery, pruned: dict, ppl_value: float, reference: str, seconds: float, **extra):
    return {"cut": cut, "criterion": criterion, "method": comp, "recovery": recovery, **pruned,
            "ppl": ppl_value, "reference": reference, "seconds": round(seconds, 1), **extra}  # fmt: skip


def measure(bench: Bench, model) -> tuple[float, dict | None]:
    """(perplexity on the test tokens, last-word accuracy or None) of ``model``."""
    return ppl(model, bench.test_ids, bench.args, bench.device), bench.lastword(model)


def one_shot_rows(bench: Bench, scores: dict, cut: str, keep: dict) -> list[dict]:
    """Every criterion x compensation; the pruned models the recovery rows may start from go into ``keep``."""
    rows = []
    for criterion in bench.args.criteria:
        heads = bench.select(scores[criterion], cut)
        for comp in bench.args.compensations:
            start = time.perf_counter()
            model = bench.fresh()
            pruned = bench.prune(model, scores[criterion], cut, comp)
            value, accuracy = measure(bench, model)
            r = row(cut, criterion, comp, "one-shot", pruned, value, "unpruned", time.perf_counter() - start,
                    layers_touched=len(heads), per_layer=sorted({len(h) for h in heads.values()}),
                    lastword=accuracy)  # fmt: skip
            rows.append(r)
            report(r)
            if comp in bench.args.recovery_compensations:
                keep[cut, criterion, comp] = (model, pruned)
            del model
    return rows


def trained_row(bench: Bench, cut: str, best: str, comp: str, distill: bool, keep: dict) -> dict:
    """The one-shot row's pruned (and compensated) model, ``N`` steps of LM fine-tune or distillation, perplexity."""
    start = time.perf_counter()
    source, pruned = keep[cut, best, comp]
    model = copy.deepcopy(source).requires_grad_(True)
    pruned = {**pruned, "train": bench.train(model, distill=distill)}
    value, accuracy = measure(bench, model)
    name = f"{'distillation' if distill else 'LM fine-tune'} {bench.args.steps} steps"
    r = row(cut, best, comp, name, pruned, value, "unpruned fine-tuned", time.perf_counter() - start,
            lastword=accuracy)  # fmt: skip
    report(r)
    return r


def iterative_row(bench: Bench, cut: str, best: str, comp: str) -> dict:
    start = time.perf_counter()
    model = bench.fresh()
    pruned = bench.iterative(model, best, cut, comp)
    value, accuracy = measure(bench, model)
    r = row(cut, best, comp, f"iterative, {bench.args.rounds} rounds", pruned, value, "unpruned",
            time.perf_counter() - start, lastword=accuracy)  # fmt: skip
    report(r)
    return r


def report(r: dict) -> None:
    comp = r.get("compensation")
    extra = f", compensation {comp['seconds']:.1f} s" if isinstance(comp, dict) else ""
    print(f"  {r['cut']:<11} {r['criterion']:<10} {r['method']:<5} "
          f"{r['recovery']:<24} removed {r['heads_removed']:>3}  ppl {r['ppl']:9.2f}  last-word "
          f"{acc_text(r.get('lastword'))}  [{r['seconds']:.0f} s{extra}]",
          flush=True)  # fmt: skip


# -- output -----------------------------------------------------------------------------------------


def cut_table(rows: list[dict], refs: dict) -> str:
    lines = []
    for r in rows:
        ref = refs[r["reference"]]
        lines.append([r["criterion"], r["method"], r["recovery"], r["heads_removed"], f"{r['params']:,}",
                      f"{r['ppl']:.2f}", f"{r['ppl'] / ref:.3f}", r["reference"], acc_text(r.get("lastword")),
                      f"{r['seconds']:.0f}"])  # fmt: skip
    return common.table(["criterion", "compensation", "recovery", "heads removed", "params", "perplexity",
                         "ratio", "ratio to", "last-word acc", "row s"], lines, "lllrrrrlrr")  # fmt: skip


def targets(rows: list[dict], refs: dict, layer_bytes: int, args) -> list[dict]:
    """The issue's targets: best matching row, measured ratio, PASS/FAIL."""

    def best(cut, pred, ref):
        found = [r for r in rows if r["cut"] == cut and pred(r)]
        if not found:
            return None
        r = min(found, key=lambda r: r["ppl"])
        return r["ppl"] / refs[ref], f"{r['criterion']} + {r['method']}, {r['recovery']}"

    comp = lambda r: r["method"] in ("lsq", "bias")  # noqa: E731
    distilled = lambda r: r["recovery"].startswith("distillation")  # noqa: E731
    out = []
    for name, cut, pred, ref, limit in (
        ("10% heads, one-shot with compensation", GLOBAL, lambda r: comp(r) and r["recovery"] == "one-shot",
         "unpruned", 1.05),
        ("uniform 33% heads, one-shot with compensation", UNIFORM,
         lambda r: comp(r) and r["recovery"] == "one-shot", "unpruned", 1.20),
        ("10% heads after distillation", GLOBAL, distilled, "unpruned fine-tuned", 1.02),
        ("uniform 33% heads, compensation + distillation", UNIFORM, lambda r: comp(r) and distilled(r),
         "unpruned fine-tuned", 1.08),
    ):  # fmt: skip
        found = best(cut, pred, ref)
        measured = None if found is None else found[0]
        out.append({"target": f"{name}: ppl <= {limit:.2f} x {ref}", "limit": limit, "measured": measured,
                    "row": None if found is None else found[1],
                    "pass": None if measured is None else measured <= limit})  # fmt: skip
    lsq = [r["compensation"] for r in rows if r["method"] == "lsq" and r["recovery"] == "one-shot"]
    full = args.calib_batches == 16 and args.calib_seq_len == 512
    note = "" if full else f" (measured with {args.calib_batches} x {args.calib_seq_len} tokens, not 16 x 512)"
    secs = max((c["seconds"] for c in lsq), default=None)
    out.append({"target": "lsq compensation < 10 s (16 x 512 calibration tokens)" + note, "limit": 10.0,
                "measured": secs, "row": "slowest one-shot lsq row",
                "pass": None if secs is None else secs < 10.0})  # fmt: skip
    peak = max((c["peak_added_bytes"] for c in lsq), default=None)
    out.append(
        {
            "target": f"lsq added peak memory < 2 layers' weights ({2 * layer_bytes / 2**20:.1f} MiB)",
            "limit": 2 * layer_bytes / 2**20,
            "measured": None if peak is None else peak / 2**20,
            "row": "largest one-shot lsq row",
            "pass": None if peak is None else peak < 2 * layer_bytes,
        }
    )
    return out


def print_targets(found: list[dict]) -> None:
    lines = []
    for t in found:
        m = t["measured"]
        if m is None:
            shown, verdict = "-", "not run"
        elif "MiB" in t["target"]:
            shown, verdict = f"{m:.1f} MiB", "PASS" if t["pass"] else "FAIL"
        elif "< 10 s" in t["target"]:
            shown, verdict = f"{m:.1f} s", "PASS" if t["pass"] else "FAIL"
        else:
            shown, verdict = f"{m:.3f} ({(m - 1) * 100:+.1f}%)", "PASS" if t["pass"] else "FAIL"
        lines.append([t["target"], shown, t["row"] or "-", verdict])
    print(common.table(["target", "measured", "best row", "verdict"], lines, "lrll"))


def plot(path: Path, rows: list[dict], refs: dict, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cuts = list(dict.fromkeys(r["cut"] for r in rows))
    height = max(4.0, 0.22 * max(sum(r["cut"] == c for r in rows) for c in cuts) + 1.5)
    fig = Figure(figsize=(6.0 * len(cuts), height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(cuts), squeeze=False)[0]
    colors = {"none": "0.55", "lsq": "C0", "bias": "C2"}
    for ax, cut in zip(axes, cuts, strict=True):
        sub = [r for r in rows if r["cut"] == cut]
        labels = [f"{r['criterion']} / {r['method']} / {r['recovery']}" for r in sub]
        ax.barh(range(len(sub)), [r["ppl"] for r in sub], color=[colors[r["method"]] for r in sub])
        ax.set_yticks(range(len(sub)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        for name, style in (("unpruned", ":"), ("unpruned fine-tuned", "--")):
            if name in refs:
                ax.axvline(refs[name], color="k", lw=0.9, ls=style, label=f"{name} ({refs[name]:.2f})")
        ax.set_xlabel("test perplexity (log)")
        ax.set_title(cut, fontsize=10)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# -- main -------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    if "--units" in (sys.argv[1:] if argv is None else argv):
        import bench_units  # units at matched parameter cuts (docs/benchmarks.md section 9)

        return bench_units.main(argv, script=__file__)
    with common.quiet("sinv_prune", "transformers", "accelerate"):
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    device = common.pick_device(args.device)
    title = "Recovery after head pruning (bench_recovery)"
    started = common.begin_wikitext_run(args, title, __file__, argv, device, args.threads if device == "cpu" else None)
    if started is None:
        return 0
    info, result = started
    t_start = time.perf_counter()
    bench, base, model_info, test_ids, ft_data = setup_bench(args, device)
    lay = bench.layouts[0]
    heads = sum(x.num_heads for x in bench.layouts)
    print(f"model: {model_info['model']}; {len(bench.layouts)} layers x {lay.num_heads} query / {lay.num_kv_heads} KV "
          f"heads = {heads} heads, {count_parameters(base):,} parameters")  # fmt: skip
    print(f"evaluation: WikiText-2 test.txt, first {test_ids.numel():,} tokens, windows of {args.seq_len}, float32")
    print(f"calibration: {args.calib_batches} x {args.calib_seq_len} valid.txt tokens (taylor / activation score on "
          f"the first {args.score_batches}); lsq ridge picked on held-out calibration tokens (the default); "
          f"bias rows use add_bias=True (LLaMA's o_proj has no bias)")  # fmt: skip
    print(
        f"fine-tune and distillation: {args.steps} steps x {args.batch} x {args.ft_seq_len} valid.txt tokens "
        f"after the calibration ones ({len(ft_data)} blocks), run_trainer, AdamW lr {args.lr:g} constant, clip "
        f"1.0; distillation alpha {args.alpha:g}, temperature {args.temperature:g}, teacher the unpruned model"
    )
    print(
        f"one-shot criteria: {', '.join(args.criteria)} (random: seed 0); compensations: "
        f"{', '.join(args.compensations)}; fine-tune / distillation / iterative ({args.rounds} rounds) rows: only "
        f"for the best one-shot + lsq criterion of each cut, compensations {', '.join(args.recovery_compensations)}"
    )
    print(flush=True)

    refs, accs, ref_rows, cached = {}, {}, [], []
    for name, finetuned in (("unpruned", False), ("unpruned fine-tuned", True)):
        start = time.perf_counter()
        measured, hit = bench.reference(finetuned)
        refs[name], accs[name] = measured["ppl"], measured["lastword"]
        cached += [name] if hit else []
        label = f"unpruned, LM fine-tune {args.steps} steps" if finetuned else "unpruned"
        when = "cached" if hit else f"{time.perf_counter() - start:.0f} s"
        print(f"  {label}: ppl {refs[name]:.2f}  last-word {acc_text(accs[name])}  [{when}]", flush=True)
    ref_rows.append({"name": "unpruned fine-tuned", "train": measured["train"], "ppl": refs["unpruned fine-tuned"]})

    scores, score_s = {}, {}
    for criterion in args.criteria:
        start = time.perf_counter()
        scorer = HeadPruner(criterion, 0, criterion_options=OPTIONS.get(criterion))
        scores[criterion] = scorer.score(base, bench.score_batches)["heads"]
        score_s[criterion] = round(time.perf_counter() - start, 2)
    print(f"  scores: {', '.join(f'{k} {v:.1f} s' for k, v in score_s.items())}", flush=True)

    rows, choices, keep = [], {}, {}
    partial = {**result, "model": model_info, "references": refs, "rows": rows, "choices": choices}
    for cut in (GLOBAL, UNIFORM):
        plans = {c: bench.select(scores[c], cut) for c in args.criteria}
        shapes = {c: (sum(map(len, p.values())), len(p), sorted({len(h) for h in p.values()}))
                  for c, p in plans.items()}  # fmt: skip
        print(f"{cut}: " + "; ".join(f"{c} removes {n} heads in {k} layers ({'/'.join(map(str, per))} per layer)"
                                     for c, (n, k, per) in shapes.items()), flush=True)  # fmt: skip
        cut_rows = one_shot_rows(bench, scores, cut, keep)
        lsq = [r for r in cut_rows if r["method"] == "lsq"] or cut_rows
        choices[cut] = min(lsq, key=lambda r: r["ppl"])["criterion"]
        print(f"{cut}: best one-shot {'+ lsq ' if lsq[0]['method'] == 'lsq' else ''}criterion: {choices[cut]}; the "
              f"fine-tune, distillation and iterative rows use it", flush=True)  # fmt: skip
        for key in [k for k in keep if k[0] == cut and k[1] != choices[cut]]:
            del keep[key]
        rows += cut_rows
        common.write_json(args.json, partial)  # what is done so far, should the run be stopped
    # Recovery rows, most wanted first (the targets need distillation), while the time budget lasts.
    todo = [(cut, comp, distill) for distill in (True, False) for cut in (GLOBAL, UNIFORM)
            for comp in args.recovery_compensations]  # fmt: skip
    skipped = []
    for cut, comp, distill in todo:
        if over_budget(args, t_start):
            skipped.append(f"{cut} {comp} {'distillation' if distill else 'LM fine-tune'}")
            continue
        rows.append(trained_row(bench, cut, choices[cut], comp, distill, keep))
        common.write_json(args.json, partial)
    keep.clear()
    print(f"  iterative rows skipped for {UNIFORM}: a uniform cut comes in steps of one head per KV group in "
          f"every layer ({sum(lay.num_kv_heads for lay in bench.layouts)} heads), which is the whole cut",
          flush=True)  # fmt: skip
    for comp in args.recovery_compensations:
        if over_budget(args, t_start):
            skipped.append(f"{GLOBAL} {comp} iterative")
            continue
        rows.append(iterative_row(bench, GLOBAL, choices[GLOBAL], comp))
        common.write_json(args.json, partial)
    if skipped:
        print(f"  time budget ({args.max_minutes:g} min) spent: skipped {'; '.join(skipped)}", flush=True)

    print()
    print(f"unpruned perplexity {refs['unpruned']:.2f} (last-word accuracy {acc_text(accs['unpruned'])}); unpruned "
          f"after the same {args.steps}-step LM fine-tune {refs['unpruned fine-tuned']:.2f} (last-word "
          f"{acc_text(accs['unpruned fine-tuned'])}); {count_parameters(base):,} parameters")  # fmt: skip
    if bench.lastword.items:
        print(f"last-word accuracy: wikitext_lastword through lm-eval, the first {bench.lastword.items} items, "
              "± its standard error")  # fmt: skip
    for cut in (GLOBAL, UNIFORM):
        print(f"\n{cut} (fine-tune / distillation / iterative rows: {choices[cut]}, the best one-shot + lsq "
              f"criterion)")  # fmt: skip
        print(cut_table([r for r in rows if r["cut"] == cut], refs))
    lsq = [r for r in rows if r["method"] == "lsq" and r["recovery"] == "one-shot"]
    layer_bytes = layer_weight_bytes(base)
    if lsq:
        print(f"\nlsq compensation ({args.calib_batches} x {args.calib_seq_len} calibration tokens): "
              + "; ".join(f"{r['cut']} {r['criterion']}: {r['compensation']['seconds']:.1f} s, +"
                          f"{r['compensation']['peak_added_bytes'] / 2**20:.0f} MiB peak, layer error "
                          f"{r['compensation']['mean_error_before']:.3f} -> {r['compensation']['mean_error_after']:.3f}"
                          for r in lsq)
              + f" (one layer's weights: {layer_bytes / 2**20:.1f} MiB; peak memory: "
              + ("CUDA allocator)" if device.startswith("cuda") else "process RSS sampled every 5 ms)"))  # fmt: skip
    found = targets(rows, refs, layer_bytes, args)
    print("\ntargets (issue 11):")
    print_targets(found)
    elapsed = time.perf_counter() - t_start
    common.finish(info)
    print(f"elapsed {elapsed:.0f} s")
    result.update({"skipped": skipped, "model": model_info, "heads": heads, "eval_tokens": int(test_ids.numel()),
                   "references": refs, "references_cached": cached,
                   "lastword_references": accs, "lastword_items": bench.lastword.items,
                   "reference_rows": ref_rows, "score_s": score_s, "choices": choices, "rows": rows,
                   "targets": found, "layer_weight_bytes": layer_bytes, "elapsed_s": round(elapsed, 1)})  # fmt: skip
    if args.plot:
        title = (f"{model_info['model'].split(' (')[0]}: WikiText-2 test perplexity, {test_ids.numel():,} tokens; "
                 f"fine-tune / distillation {args.steps} steps")  # fmt: skip
        plot(args.plot, rows, refs, title)
        result["plot"] = str(args.plot)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
