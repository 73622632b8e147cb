"""Figures at LLaMA-3-8B scale through the public API: surgery, measures, criteria, pruned speed.

One table, one row per figure:

* ``surgery``: time and added peak memory of ``sinv_prune.prune_heads`` removing 25% of the heads
  (one query head per KV group in every layer, ``layout="q_per_group"``; and two whole KV groups per
  layer, ``layout="kv_groups"``), and of ``sinv_prune.prune(model, plan)`` removing 25% of every
  MLP's channels (every fourth) or 25% of the layers (every fourth) where that function exists;
* ``head_measures``: time and added peak memory of ``sinv_prune.head_measures(model)``;
* ``criterion``: ``taylor``, ``entropy`` and ``activation`` scored over ``--score-batches`` batches of
  ``--score-batch`` x ``--score-len`` random tokens (``Criterion.compute``): time and added peak memory;
* ``prefill``: one forward of ``--batch`` x ``--prefill-len`` tokens with the KV cache written and the
  last position's logits (as ``generate()`` prefills), unpruned vs each 25% cut, ABBA-interleaved,
  median per-pair ratio; predicted speed-up from the FLOPs (``_bench_common.forward_flops``:
  attention projections + scores + MLP + one lm_head position);
* ``decode``: ``--decode-tokens`` greedy steps of one token per sequence after that prefill; the
  predicted speed-up is the ratio of bytes read per step, weights (every parameter but the input
  embedding) plus the KV cache at the mean context: decoding a small batch is memory-bound.

Peak memory is ``torch.cuda.max_memory_allocated`` minus the allocation just before the call (CUDA
only; "n/a" on the CPU). Weights are random (speed and memory do not depend on the values), built
directly on the device in ``--dtype`` (``with torch.device(device)``: no CPU copy of 16 GB).

    python scripts/bench_scale.py --device cuda --shape llama3-8b      # one GPU, ~2 min
    python scripts/bench_scale.py --device cpu --shape tiny            # the same code on a tiny shape
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402

import sinv_prune  # noqa: E402

GiB = 2**30

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=8,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False),
}  # fmt: skip
#: Workload per shape: (batch, prefill length, decode steps, score batches, score batch, score length, repeats)
WORKLOADS = {
    "llama3-8b": dict(batch=4, prefill_len=2048, decode_tokens=32, score_batches=4, score_batch=4, score_len=512,
                      repeats=5),
    "tiny": dict(batch=2, prefill_len=64, decode_tokens=4, score_batches=2, score_batch=2, score_len=32, repeats=2),
}  # fmt: skip
CRITERIA = ("taylor", "entropy", "activation")


# -- model and cuts ------------------------------------------------------------------------------


def build(shape: str, layers: int | None, device: str, dtype: torch.dtype, seed: int = 0):
    """A LLaMA model of ``shape`` with random weights, allocated and initialised on ``device``."""
    import transformers

    kwargs = dict(SHAPES[shape])
    if layers:
        kwargs["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(bos_token_id=0, eos_token_id=None, pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    if next(model.parameters()).device.type != torch.device(device).type:  # a transformers ignoring the context
        model.to(device)
    return model.eval()


def head_plans(model) -> list[tuple[str, dict[int, list[int]]]]:
    """25% of every layer's query heads: one per KV group (KV stays), and whole KV groups (KV shrinks)."""
    adapter = sinv_prune.get_adapter(model)
    lays = [adapter.layout(i) for i in range(adapter.num_layers)]
    scores = sinv_prune.get_criterion("random", seed=0).scores(model)
    per_layer = lays[0].num_heads // 4
    out = []
    for name, layout in (("heads 25% (1 q/group)", "q_per_group"), ("heads 25% (KV groups)", "kv_groups")):
        plan = sinv_prune.select_heads(scores, per_layer * len(lays), layouts=lays, mode="uniform", layout=layout,
                                       exact=True)  # fmt: skip
        out.append((name, plan))
    return out


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads: all but the input embedding (one row of it is read)."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embed.numel() * embed.element_size()


def decode_bytes(model, batch: int, context: int) -> int:
    return weight_bytes(model) + common.kv_cache_bytes(model, batch, context)


# -- measuring -----------------------------------------------------------------------------------


def measure(fn: Callable[[], object], device: str) -> tuple[float, int | None, object]:
    """(seconds, peak bytes allocated above the start or ``None`` off CUDA, result) of one call."""
    cuda = device.startswith("cuda")
    common.sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    start = time.perf_counter()
    result = fn()
    common.sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - start_bytes if cuda else None
    return seconds, peak, result


def _prefill(model, ids):
    return model(input_ids=ids, use_cache=True, logits_to_keep=1)


def _decode(model, ids, steps: int, device: str) -> float:
    """Seconds for ``steps`` greedy one-token steps after an (untimed) prefill of ``ids``."""
    out = _prefill(model, ids)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    common.sync(device)
    start = time.perf_counter()
    with warnings.catch_warnings():  # transformers 5.2x renames past_key_values to cache; both are accepted
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
    common.sync(device)
    return time.perf_counter() - start


def abba(a, b, run: Callable[[object], float], repeats: int) -> dict:
    """``run(model) -> seconds`` for ``a`` and ``b``, one warm-up each, then ``repeats`` pairs in ABBA order."""
    run(a), run(b)
    times = {"a": [], "b": []}
    for i in range(repeats):
        for key, model in (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a)):
            times[key].append(run(model))
    ratio = statistics.median(x / y for x, y in zip(times["a"], times["b"], strict=True))
    return {"a_s": statistics.median(times["a"]), "b_s": statistics.median(times["b"]), "speedup": ratio}


def speed(base, pruned, args, device: str, gen: torch.Generator) -> dict:
    ids = torch.randint(1, base.config.vocab_size, (args.batch, args.prefill_len), generator=gen).to(device)

    def prefill(model) -> float:
        common.sync(device)
        start = time.perf_counter()
        _prefill(model, ids)
        common.sync(device)
        return time.perf_counter() - start

    context = args.prefill_len + args.decode_tokens // 2
    with torch.inference_mode():
        pre = abba(base, pruned, prefill, args.repeats)
        dec = abba(base, pruned, lambda m: _decode(m, ids, args.decode_tokens, device), max(1, args.repeats // 2))
    f0 = common.forward_flops(base, args.batch, args.prefill_len, logits_positions=1)["total"]
    f1 = common.forward_flops(pruned, args.batch, args.prefill_len, logits_positions=1)["total"]
    b0, b1 = decode_bytes(base, args.batch, context), decode_bytes(pruned, args.batch, context)
    return {"prefill": {**pre, "predicted": f0 / f1, "flops": (f0, f1)},
            "decode": {**dec, "predicted": b0 / b1, "bytes": (b0, b1)}}  # fmt: skip


# -- the run -------------------------------------------------------------------------------------


def _row(figure: str, cut: str = "", time_s: str = "", peak: str = "", measured: str = "", predicted: str = "",
         ratio: str = "") -> dict:  # fmt: skip
    return {"figure": figure, "cut": cut, "time": time_s, "peak": peak, "measured": measured,
            "predicted": predicted, "ratio": ratio}  # fmt: skip


def _gib(peak: int | None) -> str:
    return "n/a (CPU)" if peak is None else f"+{peak / GiB:.2f} GiB"


def _err(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"failed: {type(err).__name__}: {text[:120]}"


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _speed_rows(cut: str, result: dict, decode_tokens: int) -> list[dict]:
    rows = []
    for kind, unit in (("prefill", 1e3), ("decode", 1e3 / decode_tokens)):
        r = result[kind]
        times = f"{r['a_s'] * unit:.1f} -> {r['b_s'] * unit:.1f} ms"
        ratio = f"{r['speedup'] / r['predicted']:.0%}"
        rows.append(_row(kind, cut, times, "", f"{r['speedup']:.3f}x", f"{r['predicted']:.3f}x", ratio))
    return rows


def run_figures(args, device: str, dtype: torch.dtype) -> tuple[list[dict], dict]:
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    seconds, peak, base = measure(lambda: build(args.shape, args.layers, device, dtype), device)
    info = {"parameters": sinv_prune.count_parameters(base), "layers": base.config.num_hidden_layers,
            "build_s": seconds, "build_peak": peak}  # fmt: skip
    rows.append(_row("build (random init on device)", "", f"{seconds:.2f} s", _gib(peak)))

    cuts: list[tuple[str, Callable | None, object]] = [
        (name, sinv_prune.prune_heads, plan) for name, plan in head_plans(base)
    ]
    cuts += [(name, sinv_prune.prune, plan) for name, plan in common.structure_plans(base)]
    speed_rows = []
    for name, fn, plan in cuts:
        label = "surgery: prune_heads" if fn is sinv_prune.prune_heads else "surgery: prune"
        if plan is None:
            why = "n/a (fewer than 4 layers)"
            rows.append(_row(label, name, why))
            speed_rows += [_row(kind, name, why) for kind in ("prefill", "decode")]
            continue
        pruned = None
        try:  # one failing figure must not cost the others (a GPU run is one shot)
            pruned = copy.deepcopy(base)
            seconds, peak, _ = measure(lambda fn=fn, plan=plan, pruned=pruned: fn(pruned, plan), device)
            rows.append(_row(label, name, f"{seconds:.3f} s", _gib(peak)))
        except Exception as err:
            rows.append(_row(label, name, _err(err)))
            speed_rows += [_row(kind, name, "not run (surgery failed)") for kind in ("prefill", "decode")]
            pruned = None
        if pruned is not None:
            try:
                speed_rows += _speed_rows(name, speed(base, pruned, args, device, gen), args.decode_tokens)
            except Exception as err:
                speed_rows += [_row(kind, name, _err(err)) for kind in ("prefill", "decode")]
        del pruned
        _free(device)

    try:
        seconds, peak, _ = measure(lambda: sinv_prune.head_measures(base), device)
        rows.append(_row("head_measures", "all heads", f"{seconds:.2f} s", _gib(peak)))
    except Exception as err:
        rows.append(_row("head_measures", "all heads", _err(err)))
    _free(device)

    batches = [{"input_ids": torch.randint(1, base.config.vocab_size, (args.score_batch, args.score_len),
                                           generator=gen).to(device)} for _ in range(args.score_batches)]  # fmt: skip
    workload = f"{args.score_batches} x {args.score_batch}x{args.score_len}"
    for name in CRITERIA:
        try:
            criterion = sinv_prune.get_criterion(name)
            seconds, peak, _ = measure(lambda c=criterion: c.compute(base, batches), device)
            rows.append(_row(f"criterion: {name}", workload, f"{seconds:.2f} s", _gib(peak)))
        except Exception as err:
            rows.append(_row(f"criterion: {name}", workload, _err(err)))
        _free(device)
    return rows + speed_rows, info


TABLE_HEADERS = ["figure", "cut / workload", "time", "peak memory added", "speed-up measured",
                 "speed-up predicted", "measured / predicted"]  # fmt: skip


def format_table(rows: list[dict]) -> str:
    keys = ("figure", "cut", "time", "peak", "measured", "predicted", "ratio")
    return common.table(TABLE_HEADERS, [[r[k] for k in keys] for r in rows], "ll" + "r" * 5)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape has (memory); per-layer costs scale")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    for key in WORKLOADS["tiny"]:
        ap.add_argument("--" + key.replace("_", "-"), type=int, help=f"default {WORKLOADS['llama3-8b'][key]} "
                        f"(llama3-8b) / {WORKLOADS['tiny'][key]} (tiny)")  # fmt: skip
    ap.add_argument(
        "--threads", type=int, help="torch CPU threads (default 1 on the CPU, as bench_speed; else torch's)"
    )
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    for key, value in WORKLOADS[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.layers is not None and not 1 <= args.layers <= SHAPES[args.shape]["num_hidden_layers"]:
        ap.error(f"--layers must be in 1..{SHAPES[args.shape]['num_hidden_layers']}")
    return args


def main(argv=None) -> int:
    with common.quiet():
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    command = common.command_line(__file__, argv)
    device = common.pick_device(args.device)
    common.set_threads(args.threads or (1 if device == "cpu" else None))
    common.seed_everything(0)
    dtype = getattr(torch, args.dtype)
    info = common.machine(device)
    common.print_header("Scale figures (bench_scale)", command, info)
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    print(f"shape {args.shape}: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers"
          f"{' (of ' + str(SHAPES[args.shape]['num_hidden_layers']) + ')' if args.layers else ''}, "
          f"{shape['num_attention_heads']} query / {shape['num_key_value_heads']} KV heads, MLP "
          f"{shape['intermediate_size']}, vocabulary {shape['vocab_size']}; random weights, {args.dtype}, "
          f"device {device}")  # fmt: skip
    print(f"prefill {args.batch} x {args.prefill_len} tokens (KV cache written, last-position logits); decode "
          f"{args.decode_tokens} steps after it (ms per step); 1 warm-up + ABBA pairs ({args.repeats} prefill, "
          f"{max(1, args.repeats // 2)} decode), median per-pair ratio", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    rows, model_info = run_figures(args, device, dtype)
    print(f"{model_info['parameters']:,} parameters")
    if args.layers:
        print(f"note: {args.layers} of {SHAPES[args.shape]['num_hidden_layers']} layers built; surgery, measures "
              f"and criteria costs are per-layer sums: multiply by {SHAPES[args.shape]['num_hidden_layers']}/"
              f"{args.layers} for the full depth (embeddings and lm_head excepted)")  # fmt: skip
    print()
    text = format_table(rows)
    print(text)
    elapsed = time.perf_counter() - t0
    common.finish(info)
    print(f"elapsed {elapsed:.0f} s")
    failed = [r for r in rows if r["time"].startswith(("failed", "not run"))]
    common.write_json(args.json, {"command": command, "machine": info, "settings": {k: v for k, v in vars(args).items()
                      if not isinstance(v, Path)}, "model": model_info, "rows": rows, "table": text,
                      "elapsed_s": round(elapsed, 1)})  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
