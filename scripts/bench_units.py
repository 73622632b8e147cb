"""Quality of heads vs MLP channels vs layers vs a mix at matched parameter cuts (``bench_recovery.py --units``).

SmolLM2-135M loses 10% and 25% of its NON-EMBEDDING parameters (``count_parameters`` minus the tied
token embedding) in four arms, each with one ``Pruner`` and one ``sinv_prune.prune`` call:

* ``heads``: query heads, ``activation`` (FLAP fluctuation at ``o_proj``'s input x ``||W_O^h||``),
  global selection, ``layout="q_per_group"`` (every KV group keeps a query head; a layer loses a
  multiple of its KV-group count). At most ``(H - KV)`` query heads per layer can go, so heads alone
  cannot reach 25%: that cell reads ``n/a`` with the share all query heads hold;
* ``mlp``: MLP channels, ``activation`` with ``metric="magnitude"`` (Wanda: ``mean|x_j| x ||W_down[:, j]||``),
  ``mode="uniform"``, ``multiple=8`` (every MLP keeps the same width, a multiple of 8);
* ``layers``: whole blocks by ``block_influence`` (ShortGPT: 1 - cos(block input, block output));
* ``mix``: about half the budget from whole layers (rounded to whole blocks, ``block_influence``), the
  rest from MLP channels of the remaining layers (as in ``mlp``). Depth and width are the two units that
  reach both cuts alone; heads are left out of the mix because per parameter they hurt most (section 6).

Each unit's amount is computed from the parameters one unit holds (a query head: its ``q`` rows and
``o`` columns; a channel: its gate / up rows and down column; a layer: its block) so that the removed
parameters are as close to the target as the unit's granularity allows; the actual share (from
``count_parameters`` before / after) is printed next to every row.

Rows per arm and cut: one-shot; one-shot with ``compensate="lsq"`` (refits ``o_proj`` and the MLP down
projection from the calibration batches; whole dropped blocks have nothing to refit, so the ``layers``
arm has no lsq row); then ``--steps`` steps of distillation (teacher the unpruned model, started from the
lsq row where there is one) through ``run_trainer``. References: the unpruned model (one-shot ratios)
and the unpruned model LM-fine-tuned the same steps on the same blocks (distilled ratios). Data,
perplexity and training are ``bench_recovery.py``'s. The first cut runs completely (one-shot rows, the
reference fine-tune, distillation rows); after ``--max-minutes`` no later row starts (it is listed as skipped).

    OMP_NUM_THREADS=2 python scripts/bench_recovery.py --units --threads 2 --json units.json
    python scripts/bench_recovery.py --units --quick     # seconds; tiny random LLaMA, tests the script only

``--allocations uniform standardized sensitivity search`` (issue 17) replaces the arms by one row per
allocation and cut: MLP channels (Wanda, ``multiple=8``), ``amount={"params": cut}``, one-shot with lsq
(``--alloc-methods`` adds plain rows), with the kept widths' range, whether the result loads on the stock
class, and the allocation's own time (search: its fitness before / after):

    OMP_NUM_THREADS=2 python scripts/bench_recovery.py --units --allocations uniform standardized sensitivity search
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
import _bench_setup as setup  # noqa: E402

from sinv_prune import Part, Pruner, count_parameters, get_adapter  # noqa: E402
from sinv_prune.pipeline.stages import StoredScores  # noqa: E402
from sinv_prune.scoring.allocation import allocations  # noqa: E402
from sinv_prune.surgery.record import get_record  # noqa: E402

CUTS = (0.10, 0.25)
ARMS = ("heads", "mlp", "layers", "mix")
MULTIPLE = 8
CRITERIA = {"heads": ("activation", None), "mlp": ("activation", {"metric": "magnitude"}),
            "layers": ("block_influence", None)}  # fmt: skip
TARGETS = ((0.10, "one-shot", 1.10, "unpruned"), (0.10, "distilled", 1.03, "unpruned fine-tuned"))


def parse(argv):
    ap = argparse.ArgumentParser(prog="bench_recovery.py --units", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--units", action="store_true", help="this mode (bench_recovery.py passes it on)")
    ap.add_argument("--quick", action="store_true", help="tiny random LLaMA, tiny budgets: tests the script only")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--allocations", nargs="+", choices=allocations(),
                    help="instead of the arms: MLP-channel rows per allocation (issue 17)")  # fmt: skip
    ap.add_argument("--alloc-methods", nargs="+", choices=("none", "lsq", "obs"), default=["lsq"],
                    help="compensation of the allocation rows (default lsq; obs: OBS selection + refit)")  # fmt: skip
    ap.add_argument("--search-budget", type=int, help="search allocation: fitness evaluations (default: the library's)")
    ap.add_argument("--cuts", nargs="+", type=float, default=list(CUTS), help="fractions of non-embedding params")
    ap.add_argument("--eval-tokens", type=int, help="test.txt tokens evaluated (default 16384)")
    ap.add_argument("--seq-len", type=int, help="perplexity window (default 512)")
    ap.add_argument("--lastword", type=int, help="wikitext_lastword items for the last-word accuracy column "
                    "(lm-eval; default 200, --quick 4; 0: no column)")  # fmt: skip
    ap.add_argument("--calib-batches", type=int, help="calibration batches for lsq (default 16)")
    ap.add_argument("--calib-seq-len", type=int, help="tokens per calibration batch (default 512)")
    ap.add_argument("--score-batches", type=int, help="calibration batches the criteria score on (default 4)")
    ap.add_argument("--steps", type=int, help="distillation / reference fine-tune steps N (default 4)")
    ap.add_argument("--batch", type=int, help="blocks per step (default 4)")
    ap.add_argument("--ft-seq-len", type=int, help="tokens per block (default 256)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, clip 1.0)")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.5, help="distillation weight of the KL term")
    ap.add_argument("--max-minutes", type=float, help="after this many minutes start no row beyond the first cut "
                    "(default 30; --quick: no limit)")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args(argv)
    preset = {  # quick, default
        "eval_tokens": (256, 16384),
        "lastword": (4, 200),
        "seq_len": (64, 512),
        "calib_batches": (2, 16),
        "calib_seq_len": (32, 512),
        "score_batches": (1, 4),
        "steps": (1, 4),
        "batch": (2, 4),
        "ft_seq_len": (32, 256),
        "max_minutes": (None, 30.0),
    }
    for key, values in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, values[0 if args.quick else 1])
    if args.score_batches > args.calib_batches:
        ap.error(f"--score-batches ({args.score_batches}) exceeds --calib-batches ({args.calib_batches})")
    bad = [c for c in args.cuts if not 0.0 < c < 1.0]
    if bad:
        ap.error(f"--cuts must be fractions in (0, 1), got {bad}")
    return args


# -- parameter budget -------------------------------------------------------------------------------


@dataclass
class Costs:
    """Parameters the model holds per unit (what removing one takes away) and the non-embedding total."""

    total: int
    embedding: int
    per_head: int
    per_channel: int
    per_layer: int
    layers: int
    heads_per_layer: int
    kv_per_layer: int
    channels_per_layer: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    def share(self, params: int) -> float:
        return params / self.non_embedding


def costs(model) -> Costs:
    """The unit costs of an unpruned model with identical layers (SmolLM2, the tiny LLaMA)."""
    adapter = get_adapter(model)
    embeddings = {id(p): p.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
                  if m is not None for p in m.parameters()}  # fmt: skip
    lay, proj = adapter.layout(0), adapter.projections(0)
    channels = adapter.intermediate_size(0)
    per_channel = sum(p.numel() for m in adapter.mlp_in(0) for p in m.parameters()) + adapter.mlp_out(0).weight.numel()
    return Costs(
        total=count_parameters(model),
        embedding=sum(embeddings.values()),
        per_head=(proj.q.numel() + proj.o.numel()) // lay.num_heads,
        per_channel=per_channel // channels,
        per_layer=sum(p.numel() for p in adapter.layers()[0].parameters()),
        layers=adapter.num_layers,
        heads_per_layer=lay.num_heads,
        kv_per_layer=lay.num_kv_heads,
        channels_per_layer=channels,
    )


def mlp_amount(c: Costs, budget: float, layers_kept: int) -> int:
    """Channels (uniform: the same in every kept layer, kept width a multiple of ``MULTIPLE``) closest to ``budget``."""
    step_ok = [r for r in range(c.channels_per_layer) if (c.channels_per_layer - r) % MULTIPLE == 0]
    best = min(step_ok, key=lambda r: abs(r * layers_kept * c.per_channel - budget))
    return best * layers_kept


def plan_arm(arm: str, cut: float, c: Costs) -> dict | str:
    """``{unit: amount}`` for ``arm`` at ``cut``, or why it cannot reach it."""
    budget = cut * c.non_embedding
    if arm == "heads":
        groups = c.kv_per_layer
        most = (c.heads_per_layer - groups) * c.layers  # q_per_group: every KV group keeps one query head
        want = groups * math.floor(budget / (c.per_head * groups) + 0.5)
        if want > most:
            return (f"n/a (all query heads' q/o hold only {c.share(c.per_head * c.heads_per_layer * c.layers):.1%}; "
                    f"q_per_group can remove at most {c.share(c.per_head * most):.1%})")  # fmt: skip
        return {"heads": want}
    if arm == "layers":
        return {"layers": min(c.layers - 1, math.floor(budget / c.per_layer + 0.5))}
    if arm == "mlp":
        return {"mlp": mlp_amount(c, budget, c.layers)}
    depth = min(c.layers - 1, max(1, math.floor(budget / 2 / c.per_layer + 0.5)))
    return {"layers": depth, "mlp": mlp_amount(c, budget - depth * c.per_layer, c.layers - depth)}


def pruner(amounts: dict, comp: str | None, seed: int, scores: dict) -> Pruner:
    """One ``Pruner`` for the arm: a ``Part`` per unit on the scores computed once for the unpruned model."""
    parts = []
    for unit, amount in amounts.items():
        name, _ = CRITERIA[unit]
        keys = {"heads": {"layout": "q_per_group"}, "mlp": {"mode": "uniform", "multiple": MULTIPLE}}.get(unit, {})
        parts.append(Part(unit, StoredScores(name, unit, scores[unit]), amount, seed=seed, exact=True, **keys))
    return Pruner(parts, compensate=comp)


# -- rows -------------------------------------------------------------------------------------------


def one_shot(bench, c: Costs, arm: str, cut: float, amounts: dict, comp: str | None, scores: dict) -> tuple:
    start = time.perf_counter()
    model = bench.fresh()
    summary = pruner(amounts, comp, bench.args.seed, scores).prune(model, calibration=bench.calib if comp else None)
    value = setup.ppl(model, bench.test_ids, bench.args, bench.device)
    removed = summary.params_before - summary.params_after
    r = {"cut": cut, "arm": arm, "recovery": "one-shot", "method": comp or "none", "amounts": amounts,
         "heads_removed": summary.heads_removed, "channels_removed": summary.channels_removed,
         "layers_removed": summary.layers_removed, "removed_layers": summary.removed_layers_original,
         "params": summary.params_after, "params_removed": removed, "share": c.share(removed), "ppl": value,
         "reference": "unpruned", "lastword": bench.lastword(model),
         "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    if summary.compensation is not None:
        r["compensation_s"] = round(summary.compensation.seconds, 1)
    report(r)
    return r, model


def distilled(bench, c: Costs, source, start_row: dict) -> dict:
    start = time.perf_counter()
    model = copy.deepcopy(source).requires_grad_(True)
    train = bench.train(model, distill=True)
    value = setup.ppl(model, bench.test_ids, bench.args, bench.device)
    r = {**start_row, "recovery": f"distillation {bench.args.steps} steps", "train": train, "ppl": value,
         "lastword": bench.lastword(model),
         "reference": "unpruned fine-tuned", "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    report(r)
    return r


def removed_text(r: dict) -> str:
    parts = [f"{r[k + '_removed']} {k}" for k in ("heads", "channels", "layers") if r[k + "_removed"]]
    return ", ".join(parts) or "nothing"


def report(r: dict) -> None:
    comp = f", lsq {r['compensation_s']:.1f} s" if "compensation_s" in r else ""
    print(f"  {r['cut']:>4.0%} {r['arm']:<6} {r['method']:<4} {r['recovery']:<22} {removed_text(r):<28} "
          f"-{r['share']:.2%}  ppl {r['ppl']:9.2f}  last-word {setup.acc_text(r['lastword'])}  "
          f"[{r['seconds']:.0f} s{comp}]", flush=True)  # fmt: skip


# -- output -----------------------------------------------------------------------------------------


def cut_table(rows: list[dict], refs: dict, cut: float, notes: dict) -> str:
    lines = []
    for arm in ARMS:
        if (cut, arm) in notes:
            lines.append([arm, "-", notes[cut, arm], "-", "-", "-", "-"])
            continue
        mine = [r for r in rows if r["cut"] == cut and r["arm"] == arm]
        if not mine:
            continue
        get = {(r["recovery"].split(" ")[0], r["method"]): r for r in mine}
        dist = [r for r in mine if r["recovery"] != "one-shot"]
        lines.append([arm, criteria_text(mine[0]["amounts"]), removed_text(mine[0]), f"{mine[0]['share']:.2%}",
                      _cell(get.get(("one-shot", "none")), refs["unpruned"]),
                      _cell(get.get(("one-shot", "lsq")), refs["unpruned"]),
                      _cell(dist[0] if dist else None, refs.get("unpruned fine-tuned"))])  # fmt: skip
    return common.table(["arm", "criteria", "removed", "non-emb. params removed", "one-shot (ratio; last-word acc)",
                         "one-shot + lsq", "distilled (ratio to unpruned fine-tuned)"], lines,
                        "llllrrr")  # fmt: skip


def _cell(r: dict | None, ref: float | None) -> str:
    if r is None:
        return "-"
    acc = f"; acc {r['lastword']['acc']:.3f}" if r.get("lastword") else ""
    return f"{r['ppl']:.2f} ({r['ppl'] / ref:.3f}){acc}"


def criteria_text(amounts: dict) -> str:
    out = []
    for unit in amounts:
        name, options = CRITERIA[unit]
        extra = f" {options['metric']}" if options else ""
        mode = {"heads": " global q_per_group", "mlp": f" uniform x{MULTIPLE}"}.get(unit, "")
        out.append(f"{unit}: {name}{extra}{mode}")
    return "; ".join(out)


def targets(rows: list[dict], refs: dict) -> list[dict]:
    """Issue 12: at -10%, the best cut one-shot with compensation (where a unit has something to refit) and
    after distillation."""
    out = []
    for cut, stage, limit, ref in TARGETS:
        if stage == "one-shot":
            by_arm = {}
            for r in rows:
                refit = r["method"] == "lsq" or r["arm"] == "layers"  # layers: nothing to refit
                if r["cut"] == cut and r["recovery"] == "one-shot" and refit:
                    by_arm[r["arm"]] = r
            found = list(by_arm.values())
            name = f"-{cut:.0%} non-embedding, one-shot with compensation"
        else:
            found = [r for r in rows if r["cut"] == cut and r["recovery"] != "one-shot"]
            name = f"-{cut:.0%} non-embedding, after distillation"
        best = min(found, key=lambda r: r["ppl"]) if found else None
        measured = None if best is None else best["ppl"] / refs[ref]
        out.append({"target": f"{name}: ppl <= {limit:.2f} x {ref}", "limit": limit, "measured": measured,
                    "row": None if best is None else f"{best['arm']} ({best['method']}, {best['recovery']})",
                    "ppl": None if best is None else best["ppl"],
                    "pass": None if measured is None else measured <= limit})  # fmt: skip
    return out


def print_targets(found: list[dict]) -> None:
    lines = []
    for t in found:
        m = t["measured"]
        shown = "-" if m is None else f"{t['ppl']:.2f}, {m:.3f} ({(m - 1) * 100:+.1f}%)"
        verdict = "not run" if m is None else "PASS" if t["pass"] else "FAIL"
        lines.append([t["target"], shown, t["row"] or "-", verdict])
    print(common.table(["target", "measured", "best row", "verdict"], lines, "lrll"))


def winners(rows: list[dict], cuts) -> dict:
    """Per cut and stage, the arm with the lowest perplexity."""
    out = {}
    for cut in cuts:
        for stage, pred in (("one-shot", lambda r: r["recovery"] == "one-shot"),
                            ("distilled", lambda r: r["recovery"] != "one-shot")):  # fmt: skip
            found = [r for r in rows if r["cut"] == cut and pred(r)]
            if found:
                best = min(found, key=lambda r: r["ppl"])
                out[f"{cut:.0%} {stage}"] = {"arm": best["arm"], "method": best["method"], "ppl": best["ppl"]}
    return out


# -- allocations (issue 17) -------------------------------------------------------------------------


def allocation_row(bench, c: Costs, cut: float, allocation: str, comp: str | None, scores: dict) -> dict:
    """MLP channels by Wanda, ``{"params": cut}``, spread over layers by ``allocation``; one-shot (+ ``comp``)."""
    start = time.perf_counter()
    model = bench.fresh()
    name, _ = CRITERIA["mlp"]
    keys = {"mode": "uniform"} if allocation == "uniform" else {"allocation": allocation}
    if allocation == "search" and bench.args.search_budget:
        keys["allocation_options"] = {"budget": bench.args.search_budget}
    part = Part("mlp", StoredScores(name, "mlp", scores["mlp"]), {"params": cut}, multiple=MULTIPLE,
                seed=bench.args.seed, **keys)  # fmt: skip
    pruner = Pruner([part], compensate=comp)
    summary = pruner.prune(model, batches=bench.calib, calibration=bench.calib)
    value = setup.ppl(model, bench.test_ids, bench.args, bench.device)
    accuracy = bench.lastword(model)
    widths = get_adapter(model).layers()
    kept = [get_adapter(model).intermediate_size(i) for i in range(len(widths))]
    removed = summary.params_before - summary.params_after
    found = pruner.last_allocation[0] if pruner.last_allocation else {}
    r = {"cut": cut, "allocation": allocation, "method": comp or "none", "channels_removed": summary.channels_removed,
         "params_removed": removed, "share": c.share(removed), "ppl": value, "lastword": accuracy,
         "kept_min": min(kept),
         "kept_max": max(kept), "kept": kept, "stock": bool(get_record(model.config).stock_layout),
         "allocation_s": found.get("seconds"), "search": found.get("search"),
         "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    if summary.compensation is not None:
        r["compensation_s"] = round(summary.compensation.seconds, 1)
    extra = ""
    if r["search"]:
        extra = f", KL {r['search']['seed_fitness']:.5f} -> {r['search']['best_fitness']:.5f}"
    print(f"  {cut:>4.0%} {allocation:<12} {r['method']:<4} {r['channels_removed']:>6} channels -{r['share']:.2%}  "
          f"widths {r['kept_min']}-{r['kept_max']}  ppl {value:8.2f}  last-word {setup.acc_text(accuracy)}  "
          f"[{r['seconds']:.0f} s, allocation "
          f"{r['allocation_s'] or 0:.0f} s{extra}]", flush=True)  # fmt: skip
    del model
    return r


def allocation_table(rows: list[dict], ref: float) -> str:
    lines = []
    for r in rows:
        search = r.get("search")
        note = f"KL {search['seed_fitness']:.4f} -> {search['best_fitness']:.4f}" if search else ""
        lines.append([f"-{r['cut']:.0%}", r["allocation"], r["method"], f"{r['channels_removed']}",
                      f"{r['share']:.2%}", f"{r['kept_min']}-{r['kept_max']}", "yes" if r["stock"] else "no",
                      f"{r['ppl']:.2f}", f"{r['ppl'] / ref:.3f}", setup.acc_text(r.get("lastword")),
                      f"{r['allocation_s'] or 0:.0f}", note])  # fmt: skip
    return common.table(["cut", "allocation", "comp.", "channels removed", "non-emb. removed", "kept widths",
                         "stock class", "ppl", "ratio", "last-word acc", "allocation s", "search"], lines,
                        "lllrrllrrrrl")  # fmt: skip


def allocation_run(args, bench, c: Costs, refs: dict, scores: dict, result: dict, model_info, test_ids, info,
                   t_start) -> int:  # fmt: skip
    rows: list[dict] = []
    partial = {**result, "model": model_info, "references": refs, "rows": rows}
    for cut in args.cuts:
        for allocation in args.allocations:
            for method in args.alloc_methods:
                rows.append(allocation_row(bench, c, cut, allocation, None if method == "none" else method, scores))
                common.write_json(args.json, partial)
    accuracy = setup.acc_text(result["lastword_references"]["unpruned"])
    print(f"\nunpruned perplexity {refs['unpruned']:.2f}, last-word accuracy {accuracy}; MLP channels by Wanda "
          f"(activation, metric magnitude), multiple {MULTIPLE}; ratios to the unpruned model")  # fmt: skip
    print(allocation_table(rows, refs["unpruned"]))
    limits = {0.10: 1.10, 0.25: 1.60}
    lines = []
    for cut in args.cuts:
        found = [r for r in rows if r["cut"] == cut and r["method"] != "none"] or [r for r in rows if r["cut"] == cut]
        best = min(found, key=lambda r: r["ppl"])
        ratio, limit = best["ppl"] / refs["unpruned"], limits.get(round(cut, 2))
        verdict = "-" if limit is None else "PASS" if ratio <= limit else f"FAIL by {(ratio - limit) * 100:.1f} points"
        lines.append([f"-{cut:.0%} one-shot with compensation", "-" if limit is None else f"<= {limit:.2f}",
                      f"{best['ppl']:.2f}, {ratio:.3f}", best["allocation"], verdict])  # fmt: skip
    print("\ntargets (issue 17):")
    print(common.table(["target", "ratio limit", "best measured", "allocation", "verdict"], lines, "lrrll"))
    elapsed = time.perf_counter() - t_start
    common.finish(info)
    print(f"elapsed {elapsed:.0f} s")
    result.update({"model": model_info, "costs": {**vars(c), "non_embedding": c.non_embedding},
                   "eval_tokens": int(test_ids.numel()), "references": refs, "rows": rows,
                   "elapsed_s": round(elapsed, 1)})  # fmt: skip
    common.write_json(args.json, result)
    return 0


# -- main -------------------------------------------------------------------------------------------


def main(argv=None, script: str = __file__) -> int:
    with common.quiet("sinv_prune", "transformers", "accelerate"):
        return run(argv, script)


def run(argv=None, script: str = __file__) -> int:
    args = parse(argv)
    device = common.pick_device(args.device)
    title = "Units at matched parameter cuts (bench_recovery --units)"
    started = common.begin_wikitext_run(args, title, script, argv, device, args.threads if device == "cpu" else None)
    if started is None:
        return 0
    info, result = started
    t_start = time.perf_counter()
    bench, base, model_info, test_ids, _ = setup.setup_bench(args, device)
    c = costs(base)
    print(f"model: {model_info['model']}; {c.total:,} parameters, of which token embedding (tied) {c.embedding:,}, "
          f"non-embedding {c.non_embedding:,}")  # fmt: skip
    print(f"unit costs: query head (q rows + o columns) {c.per_head:,} ({c.share(c.per_head):.3%}); MLP channel "
          f"{c.per_channel:,} ({c.share(c.per_channel):.4%}); layer {c.per_layer:,} ({c.share(c.per_layer):.2%}); "
          f"{c.layers} layers x {c.heads_per_layer} query / {c.kv_per_layer} KV heads, {c.channels_per_layer} "
          f"MLP channels")  # fmt: skip
    print("cuts: " + "; ".join(f"{cut:.0%} = {cut * c.non_embedding:,.0f} parameters" for cut in args.cuts))
    print(f"evaluation: WikiText-2 test.txt, first {test_ids.numel():,} tokens, windows of {args.seq_len}, float32")
    print(f"calibration: {args.calib_batches} x {args.calib_seq_len} valid.txt tokens for lsq (ridge picked on "
          f"held-out tokens, the default); criteria score on the first {args.score_batches}")  # fmt: skip
    if args.allocations:
        search = args.search_budget or "the default"
        print(f"allocation rows: one-shot, no training; search budget {search} evaluations")
    else:
        print(f"distillation: {args.steps} steps x {args.batch} x {args.ft_seq_len} valid.txt tokens after the "
              f"calibration ones, run_trainer, AdamW lr {args.lr:g} constant, clip 1.0, alpha {args.alpha:g}, "
              f"temperature {args.temperature:g}, teacher the unpruned model; reference: the unpruned model "
              f"LM-fine-tuned the same steps")  # fmt: skip
    if bench.lastword.items:
        print(f"last-word accuracy: wikitext_lastword through lm-eval, the first {bench.lastword.items} items, "
              "± its standard error")  # fmt: skip
    print(flush=True)

    refs = {}
    start = time.perf_counter()
    measured, hit = bench.reference()
    refs["unpruned"] = measured["ppl"]
    accs = result["lastword_references"] = {"unpruned": measured["lastword"]}
    result["lastword_items"] = bench.lastword.items
    cached = result["references_cached"] = ["unpruned"] if hit else []
    when = "cached" if hit else f"{time.perf_counter() - start:.0f} s"
    print(f"  unpruned: ppl {refs['unpruned']:.2f}  last-word {setup.acc_text(accs['unpruned'])}  [{when}]",
          flush=True)  # fmt: skip
    start = time.perf_counter()
    scores = {}
    if args.allocations:
        name, options = CRITERIA["mlp"]
        t0 = time.perf_counter()
        scores["mlp"] = Part("mlp", name, 0, criterion_options=options, seed=args.seed).criterion.compute(
            base, bench.score_batches
        )
        print(f"  scores mlp ({name}): {time.perf_counter() - t0:.1f} s", flush=True)
        return allocation_run(args, bench, c, refs, scores, result, model_info, test_ids, info, t_start)
    for unit, (name, options) in CRITERIA.items():
        t0 = time.perf_counter()
        part = Part(unit, name, 0, criterion_options=options, seed=args.seed)
        scores[unit] = part.criterion.compute(base, bench.score_batches)
        print(f"  scores {unit} ({name}): {time.perf_counter() - t0:.1f} s", flush=True)

    rows, notes, plans, skipped, trained = [], {}, {}, [], None
    partial = {**result, "model": model_info, "references": refs, "rows": rows}

    def over() -> bool:
        return args.max_minutes is not None and time.perf_counter() - t_start > 60 * args.max_minutes

    # Cut by cut, so the first cut (the targets') is complete before the budget guard can skip anything.
    for index, cut in enumerate(args.cuts):
        keep = {}
        for arm in args.arms:
            amounts = plan_arm(arm, cut, c)
            if isinstance(amounts, str) or (index and over()):
                notes[cut, arm] = amounts if isinstance(amounts, str) else "skipped (time budget)"
                print(f"  {cut:>4.0%} {arm:<6} {notes[cut, arm]}", flush=True)
                continue
            plans[cut, arm] = amounts
            comps = [None] if arm == "layers" else [None, "lsq"]
            for comp in comps:
                r, model = one_shot(bench, c, arm, cut, amounts, comp, scores)
                rows.append(r)
                if comp == comps[-1]:
                    keep[arm] = (model, r)
                del model
            common.write_json(args.json, partial)
        if trained is None:
            start = time.perf_counter()
            measured, hit = bench.reference(finetuned=True)
            trained = measured["train"]
            refs["unpruned fine-tuned"] = measured["ppl"]
            accs["unpruned fine-tuned"] = measured["lastword"]
            cached += ["unpruned fine-tuned"] if hit else []
            when = "cached" if hit else f"{time.perf_counter() - start:.0f} s"
            print(f"  unpruned, LM fine-tune {args.steps} steps: ppl {refs['unpruned fine-tuned']:.2f}  [{when}]",
                  flush=True)  # fmt: skip
        for arm in list(keep):
            source, start_row = keep.pop(arm)
            if index and over():
                skipped.append(f"{cut:.0%} {arm}")
                continue
            rows.append(distilled(bench, c, source, start_row))
            del source
            common.write_json(args.json, partial)
    if skipped:
        print(f"  time budget ({args.max_minutes:g} min) spent: distillation skipped for {'; '.join(skipped)}")

    print()
    tuned = setup.acc_text(accs.get("unpruned fine-tuned"))
    print(f"unpruned perplexity {refs['unpruned']:.2f} (last-word {setup.acc_text(accs['unpruned'])}); after the "
          f"same {args.steps}-step LM fine-tune {refs['unpruned fine-tuned']:.2f} (last-word {tuned}); "
          f"non-embedding parameters {c.non_embedding:,}")  # fmt: skip
    for cut in args.cuts:
        print(f"\n-{cut:.0%} of the non-embedding parameters ({cut * c.non_embedding:,.0f}); ratios to the unpruned "
              f"model, distilled to the unpruned model fine-tuned {args.steps} steps")  # fmt: skip
        print(cut_table(rows, refs, cut, notes))
    found = targets(rows, refs)
    print("\ntargets (issue 12):")
    print_targets(found)
    won = winners(rows, args.cuts)
    print("\nlowest perplexity per cut: " + "; ".join(f"{k}: {v['arm']} ({v['method']}) {v['ppl']:.2f}"
                                                      for k, v in won.items()))  # fmt: skip
    elapsed = time.perf_counter() - t_start
    common.finish(info)
    print(f"elapsed {elapsed:.0f} s")
    result.update({"model": model_info, "costs": {**vars(c), "non_embedding": c.non_embedding},
                   "eval_tokens": int(test_ids.numel()), "references": refs, "reference_train": trained,
                   "plans": {f"{cut:g} {arm}": a for (cut, arm), a in plans.items()},
                   "notes": {f"{cut:g} {arm}": n for (cut, arm), n in notes.items()}, "rows": rows,
                   "targets": found, "winners": won, "skipped": skipped, "elapsed_s": round(elapsed, 1)})  # fmt: skip
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
