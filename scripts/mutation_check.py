"""Mutation check of issue 33's code (units, experts, MoE routing, routing criteria, shrink, layer-wise engine).

Each entry of :data:`FAULTS` is one injected fault: a file, an exact text that occurs once in it, its
replacement, and the narrowest tests that should catch it. For each (one at a time) the driver patches
the file in place, runs ``python -m pytest -x -q -p no:cacheprovider <tests>`` with a timeout, and
restores the file with ``git checkout -- <file>`` (also on Ctrl-C). A fault is *caught* when pytest
fails (the first failing test is named), *survived* when the tests pass, *timeout* when they run past
the limit. Run from the repository root on a clean tree::

    nice -n 10 python scripts/mutation_check.py [--only NAME,NAME] [--timeout 90] [--json out.json]
    python scripts/mutation_check.py --check   # every old text occurs exactly once; runs nothing
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Fault:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


T_EXP = "tests/test_experts.py"
T_CRIT = "tests/test_criteria_experts.py"
T_SHRINK = "tests/test_shrink.py"
T_SHRINK_E = "tests/test_shrink_experts.py"
T_MIXED = "tests/test_mixed_plans.py"
T_STORE = "tests/test_store.py"
T_LW = "tests/test_layerwise.py"
T_CS = "tests/test_consumer_statistics.py"
T_CRIT_LW = "tests/test_criteria_layerwise.py"

DROP = f"{T_EXP}::test_dropping_layers_of_a_mixed_model_keeps_each_layers_kind_on_reload"
EVEN_LOSS = f"{T_EXP}::test_an_even_expert_cut_beside_uneven_heads_keeps_the_load_balancing_loss"
UNEVEN_LOSS = f"{T_EXP}::test_uneven_expert_counts_keep_the_load_balancing_loss"
BF16 = f"{T_EXP}::test_open_expert_gates_leave_a_bf16_model_bit_identical"
EXACT = f"{T_EXP}::test_pruned_equals_masked_router_original"
REAP_DIRECT = f"{T_CRIT}::test_reap_and_ean_equal_a_direct_computation"
REAP_DEFAULT = f"{T_CRIT}::test_reap_renormalises_by_default_where_the_config_sets_norm_topk_prob"
REFUSALS = f"{T_EXP}::test_refusals_leave_the_model_bit_identical"
ALLOCATIONS = f"{T_EXP}::test_allocations_spread_an_expert_cut"
PART = f"{T_EXP}::test_pruner_part_defaults_to_uniform_counts_and_keeps_original_ids"
UNEVEN_RELOAD = f"{T_EXP}::test_uneven_cut_reloads_through_the_record"
MOE_SEEDS = f"{T_SHRINK_E}::test_every_moe_seed_kind_meets_the_target_when_it_wins"
SEEDS = f"{T_SHRINK}::test_target_met_within_one_mlp_step_by_every_seed_kind"
FROM_SCRATCH = f"{T_SHRINK}::test_the_result_is_what_its_plan_built_from_scratch_gives"
SEED_WINS = f"{T_SHRINK}::test_a_seed_that_wins_is_what_its_plan_built_from_scratch_gives"
STOCK = f"{T_SHRINK}::test_stock_plans_reload_on_the_stock_class"
# added for the survivors of the first run
SECOND_CUT = f"{T_EXP}::test_a_second_expert_cut_records_original_ids_and_reloads"
FLOOR = f"{T_EXP}::test_every_moe_layer_keeps_num_experts_per_tok"
STEP = f"{T_EXP}::test_dropped_blocks_renumber_mlp_only_layers_and_keep_a_step_that_still_lands"
WINDOW = "tests/test_plan_surgery.py::test_dropped_blocks_keep_max_window_layers_stating_the_full_attention_layers"
LOWEST_REAP = f"{T_SHRINK_E}::test_the_experts_removed_are_those_with_the_lowest_reap_scores"
# an existing test the first selection left out: the one case where a seed is kept over a different search result
SEED_KEPT = f"{T_SHRINK}::test_the_result_is_what_its_plan_built_from_scratch_gives[0.3-2-mlp]"
SEED_OVER_SEARCH = f"{T_SHRINK}::test_a_seed_kept_over_the_search_reports_its_own_plan"

FAULTS: list[Fault] = [
    # -- surgery/shapes.py: renumbering after dropped blocks
    Fault(
        "shapes: mlp_only_layers not renumbered (stale config list)",
        "sinv_prune/surgery/shapes.py",
        "    config.mlp_only_layers = listed\n",
        "    config.mlp_only_layers = [i for i in config.mlp_only_layers if i in new]\n",
        (DROP,),
    ),
    Fault(
        "shapes: renumbering off by one (g < i - 1)",
        "sinv_prune/surgery/shapes.py",
        "new = {i: i - sum(1 for g in gone if g < i)",
        "new = {i: i - sum(1 for g in gone if g < i - 1)",
        (STEP, DROP),
    ),
    Fault(
        "shapes: sparse-step test j % step instead of (j + 1) % step",
        "sinv_prune/surgery/shapes.py",
        "if j in listed or (j + 1) % step]",
        "if j in listed or j % step]",
        (DROP,),
    ),
    Fault(
        "shapes: layer_types not renumbered",
        "sinv_prune/surgery/shapes.py",
        "config.layer_types = [t for i, t in enumerate(types) if i not in gone]",
        "config.layer_types = list(types)[: len(types) - len(gone)]",
        (T_LW, T_MIXED),
    ),
    Fault(
        "shapes: max_window_layers counts one layer too many",
        "sinv_prune/surgery/shapes.py",
        "for i in range(min(window, old)) if i not in gone)",
        "for i in range(min(window + 1, old)) if i not in gone)",
        (WINDOW, T_MIXED),
    ),
    Fault(
        "shapes: shared expert left unsliced when one channel goes (off by one)",
        "sinv_prune/units/mlp/cuts.py",
        "if 0 < len(shared) < adapter.shared_width(layer):",
        "if 0 < len(shared) < adapter.shared_width(layer) - 1:",
        (T_MIXED, "tests/test_moe_channels.py"),
    ),
    # -- units/experts/
    Fault(
        "experts: config expert count stays the original (stale attribute)",
        "sinv_prune/units/experts/__init__.py",
        "setattr(model.config, adapter.config_experts_key, count)",
        "setattr(model.config, adapter.config_experts_key, record.num_experts)",
        (EVEN_LOSS,),
    ),
    Fault(
        "experts: model.num_experts stays the original",
        "sinv_prune/units/experts/__init__.py",
        "model.num_experts = max(counts) if uneven else count",
        "model.num_experts = record.num_experts",
        (EVEN_LOSS, UNEVEN_LOSS),
    ),
    Fault(
        "experts: router logits never padded for uneven counts",
        "sinv_prune/units/experts/__init__.py",
        "_pad_router_logits_when(adapter.base, uneven)",
        "_pad_router_logits_when(adapter.base, False)",
        (UNEVEN_LOSS,),
    ),
    Fault(
        "experts: record keeps current numbering, not original",
        "sinv_prune/units/experts/__init__.py",
        "removed_original = [kept_original[e] for e in removed]",
        "removed_original = list(removed)",
        (SECOND_CUT, T_MIXED),
    ),
    Fault(
        "experts: floor of kept experts is top_k - 1",
        "sinv_prune/units/experts/__init__.py",
        "return max(top_k, min_per_layer or 0)",
        "return max(top_k - 1, min_per_layer or 0)",
        (FLOOR, REFUSALS, ALLOCATIONS, PART),
    ),
    Fault(
        "experts: rebuild slices even when the config built the kept count",
        "sinv_prune/units/experts/__init__.py",
        "        if count == len(kept):\n            return\n",
        "",
        (f"{T_EXP}::test_uniform_cut_reloads_on_the_stock_class_in_per_expert_keys", T_MIXED),
    ),
    # -- arch/moe.py
    Fault(
        "moe.route: Mixtral's top-k weights cast to the logits' dtype",
        "sinv_prune/arch/moe.py",
        "return (top.to(logits.dtype) if self.weights_in_logits_dtype else top), index",
        "return top.to(logits.dtype), index",
        (BF16,),
    ),
    Fault(
        "moe.route: renormalisation swapped",
        "sinv_prune/arch/moe.py",
        "        if self.renormalizes(router):\n            top = top / top.sum",
        "        if not self.renormalizes(router):\n            top = top / top.sum",
        (BF16, EXACT),
    ),
    Fault(
        "moe.slice_experts: module.num_experts left stale",
        "sinv_prune/arch/moe.py",
        "                module.num_experts = keep.numel()",
        "                pass",
        (EXACT, UNEVEN_RELOAD),
    ),
    Fault(
        "moe.slice_expert_channels: up rows offset by the kept count",
        "sinv_prune/arch/moe.py",
        "rows = torch.cat([keep, keep + width], dim=1)",
        "rows = torch.cat([keep, keep + count], dim=1)",
        (T_MIXED, "tests/test_moe_channels.py"),
    ),
    # -- scoring/criteria/routing.py
    Fault(
        "reap: raw softmax by default (no renormalisation)",
        "sinv_prune/scoring/criteria/routing.py",
        'return bool(getattr(model.config, "norm_topk_prob", False))',
        "return False",
        (REAP_DEFAULT,),
    ),
    Fault(
        "reap: renormalised over all experts, not the top k",
        "sinv_prune/scoring/criteria/routing.py",
        "gates = gates / gates.gather(1, index).sum(-1, keepdim=True)",
        "gates = gates / gates.sum(-1, keepdim=True)",
        (REAP_DIRECT,),
    ),
    Fault(
        "reap: sum instead of mean over routed tokens",
        "sinv_prune/scoring/criteria/routing.py",
        'stats["gated_norm_sum"] / stats["routed"].clamp_min(1), 0.0)',
        'stats["gated_norm_sum"], 0.0)',
        (REAP_DIRECT,),
    ),
    Fault(
        "routing: layer sums keep only the last batch",
        "sinv_prune/scoring/criteria/routing.py",
        'return {key: total[key] + new[key] for key in (*STATS, "tokens")}',
        'return {key: new[key] for key in (*STATS, "tokens")}',
        (T_CS, T_CRIT_LW),
    ),
    Fault(
        "routing: layer-by-layer pass merges only the first batch",
        "sinv_prune/scoring/criteria/routing.py",
        "        for per_batch in seen:\n",
        "        for per_batch in seen[:1]:\n",
        (T_CRIT_LW,),
    ),
    Fault(
        "routing: padding tokens counted",
        "sinv_prune/scoring/criteria/routing.py",
        "keep = mask.reshape(-1).to(hidden.device) != 0",
        "keep = mask.reshape(-1).to(hidden.device) >= 0",
        (f"{T_CRIT}::test_padding_tokens_are_ignored",),
    ),
    # -- scoring/consumer_statistics.py
    Fault(
        "statistics: held-out batches accumulated into the fit sums",
        "sinv_prune/scoring/consumer_statistics.py",
        'fits[key][int(held[current["batch"]])].update(',
        "fits[key][0].update(",
        (T_CS,),
    ),
    Fault(
        "statistics: REAP reads the held-out batches too",
        "sinv_prune/scoring/consumer_statistics.py",
        "else [not h for h in held]",
        "else [True for h in held]",
        (T_CS, T_SHRINK_E),
    ),
    Fault(
        "statistics: block influence is cos, not 1 - cos",
        "sinv_prune/scoring/consumer_statistics.py",
        "total += (1 - cos).sum()",
        "total += cos.sum()",
        (T_CS, f"{T_SHRINK}::test_a_block_that_does_nothing_is_the_one_dropped"),
    ),
    # -- surgery/store.py
    Fault(
        "store: one key per unit (layer left out of the key)",
        "sinv_prune/scoring/consumer_statistics.py",
        'return f"{key[0]}.{key[1]}"',
        'return f"{key[0]}"',
        (T_CS, T_STORE),
    ),
    Fault(
        "store: put ignores the requested dtype",
        "sinv_prune/surgery/store.py",
        "host = {name: None if t is None else _host(t, dtype) for",
        "host = {name: None if t is None else _host(t, None) for",
        (T_STORE, T_CS),
    ),
    Fault(
        "store: disk get loses the None entries",
        "sinv_prune/surgery/store.py",
        "tensors = load_file(str(path)) | dict.fromkeys(empty)",
        "tensors = load_file(str(path))",
        (T_STORE,),
    ),
    Fault(
        "store: get ignores the dtype",
        "sinv_prune/surgery/store.py",
        "    if dtype is not None and t.is_floating_point():\n        return t.to(device=device, dtype=dtype)\n",
        "",
        (T_STORE, T_CS),
    ),
    # -- surgery/layerwise.py
    Fault(
        "layerwise: block i fed its own input, not block i-1's output",
        "sinv_prune/surgery/layerwise.py",
        "hidden = layer.outputs if layer.outputs is not None else layer.run()",
        "_ = layer.outputs if layer.outputs is not None else layer.run()",
        (T_LW,),
    ),
    Fault(
        "layerwise: every block gets the first block's extra arguments",
        "sinv_prune/surgery/layerwise.py",
        "args, kwargs = batch.blocks[self.index]",
        "args, kwargs = batch.blocks[0]",
        (T_LW, T_CS),
    ),
    # -- surgery/checkpoint.py
    Fault(
        "checkpoint: stock route leaves the MLP width unstated",
        "sinv_prune/surgery/checkpoint.py",
        "        for width in widths:  # none in a model whose every layer is MoE\n            _set_intermediate(",
        "        for width in ():  # none in a model whose every layer is MoE\n            _set_intermediate(",
        (T_MIXED,),
    ),
    # -- shrink
    Fault(
        "shrink: seeds not repaired to the target",
        "sinv_prune/shrink/search.py",
        "g = None if g is None else space.repair(g, rng)",
        "g = g",
        (MOE_SEEDS, SEEDS),
    ),
    Fault(
        "shrink: experts with the highest REAP scores removed",
        "sinv_prune/shrink/statistics.py",
        "key=lambda e, row=row: (row[e], e)",
        "key=lambda e, row=row: (-row[e], e)",
        (LOWEST_REAP, T_SHRINK_E),
    ),
    Fault(
        "shrink: non-finite refit fallback not recorded",
        "sinv_prune/shrink/statistics.py",
        "            self._fell_back.add(key)\n",
        "",
        (f"{T_SHRINK}::test_a_refit_that_is_not_finite_is_plain_pruning_warned_once_and_recorded",),
    ),
    Fault(
        "shrink: worse held-out perplexity kept",
        "sinv_prune/shrink/search.py",
        'if ppl[best_seed] < ppl["search"]:',
        'if ppl[best_seed] > ppl["search"]:',
        (FROM_SCRATCH,),
    ),
    Fault(
        "shrink: reports the search's removal when a seed is kept",
        "sinv_prune/shrink/search.py",
        "target=target, removed=space.removed(genome),",
        "target=target, removed=space.removed(best),",
        (SEED_OVER_SEARCH, SEED_WINS, SEED_KEPT),
    ),
    Fault(
        "shrink: stock repair skipped for the uniform seed",
        "sinv_prune/shrink/search.py",
        "uniform: list[Genome | None] = [stock_space.repair(space.empty(), rng)]",
        "uniform: list[Genome | None] = [space.repair(space.empty(), rng)]",
        (MOE_SEEDS, SEEDS, STOCK),
    ),
]


def first_failure(output: str) -> str:
    """The first failing test's node id in pytest's short summary (or the error line)."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if m:
        return m.group(1).split("/")[-1]
    return output.strip().splitlines()[-1][:80] if output.strip() else "?"


def check(faults: list[Fault]) -> list[str]:
    """Every fault's old text occurs exactly once in its file; the problems otherwise."""
    problems = []
    for f in faults:
        n = (ROOT / f.file).read_text().count(f.old)
        if n != 1:
            problems.append(f"{f.name}: old text occurs {n} times in {f.file}")
    return problems


def run_fault(f: Fault, timeout: float, python: str) -> dict:
    path = ROOT / f.file
    text = path.read_text()
    path.write_text(text.replace(f.old, f.new, 1))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    try:
        proc = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *f.tests], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
        out = proc.stdout + proc.stderr
        if proc.returncode == 0:
            status, by = "survived", ""
        elif proc.returncode == 5:
            status, by = "no tests", ""
        else:
            status, by = "caught", first_failure(out)
    except subprocess.TimeoutExpired:
        status, by = "timeout", ""
    finally:
        subprocess.run(["git", "checkout", "--", f.file], cwd=ROOT, check=True)
    return {"fault": f.name, "file": f.file, "status": status, "by": by,
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated fault numbers (1-based) or name substrings")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per fault (default 90)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--check", action="store_true", help="check the old texts only; run nothing")
    args = parser.parse_args()
    faults = list(enumerate(FAULTS, 1))
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        faults = [(i, f) for i, f in faults if any(w == str(i) or (not w.isdigit() and w in f.name) for w in wanted)]
    problems = check([f for _, f in faults])
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(faults)} faults, each old text found once")
        return 0
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *{f.file for _, f in faults}], cwd=ROOT,
                           capture_output=True, text=True).stdout  # fmt: skip
    if dirty.strip():
        print(
            f"uncommitted changes in files the faults patch (git checkout would lose them):\n{dirty}", file=sys.stderr
        )
        return 2
    results = []
    print(f"{'#':>3}  {'fault':<72} {'result':<9} {'s':>6}  caught by", flush=True)
    for i, f in faults:
        r = run_fault(f, args.timeout, sys.executable)
        r["n"] = i
        results.append(r)
        print(f"{i:>3}  {f.name[:72]:<72} {r['status']:<9} {r['seconds']:>6}  {r['by']}", flush=True)
    caught = sum(r["status"] == "caught" for r in results)
    print(f"caught {caught} / {len(results)} injected")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
