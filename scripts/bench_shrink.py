"""shrink on SmolLM2-135M: one-shot rows at parameter cuts, on the evaluation of docs/benchmarks.md section 11.

Per cut: ``sinv_prune.shrink(model, params=cut)`` on the first ``--calib-sequences`` x 512 tokens of
WikiText-2 valid.txt (the bench_recovery calibration stream), then the perplexity on the first
``--eval-tokens`` test.txt tokens in windows of ``--seq-len`` (float32) and the last-word accuracy
(``wikitext_lastword`` through lm-eval, first ``--lastword`` items, all 1,403 by default), against the
unpruned model measured the same way (cached, see ``_bench_setup.Bench.reference``). Prints the search's
own table per cut, then one row per cut with the ratio to the unpruned perplexity and the search time.

    SINV_PRUNE_WIKITEXT=../shared/data/wikitext-2 python scripts/bench_shrink.py --cuts 0.1 0.25
    python scripts/bench_shrink.py --quick      # a tiny random LLaMA: tests the script only
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import _bench_common as common
from _bench_setup import Bench, acc_text, load, ppl
from bench_criteria import stream

import sinv_prune


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--cuts", nargs="+", type=float, default=[0.1, 0.25], help="shares of non-embedding params")
    ap.add_argument("--stock", action="store_true", help="shrink(stock=True): uniform shapes only")
    ap.add_argument("--budget", type=int, default=48, help="plans the search evaluates")
    ap.add_argument("--refine", action="store_true", help="shrink(refine=True): also the sequential OBS build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-sequences", type=int, help="calibration sequences of 512 tokens (default 64)")
    ap.add_argument("--eval-tokens", type=int, help="test.txt tokens evaluated (default 16384)")
    ap.add_argument("--seq-len", type=int, help="perplexity window (default 512)")
    ap.add_argument("--lastword", type=int, help="wikitext_lastword items (default all 1403; 0: no column)")
    ap.add_argument("--quick", action="store_true", help="tiny random LLaMA, tiny budgets: tests the script only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--save", help="save each shrunk model (and its tokenizer) under DIR/shrink-<cut>")
    args = ap.parse_args(argv)
    for key, (quick, full) in {"calib_sequences": (8, 64), "eval_tokens": (256, 16384), "seq_len": (64, 512),
                               "lastword": (4, 1403)}.items():  # fmt: skip
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.quick:
        args.budget = min(args.budget, 6)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    begun = common.begin_wikitext_run(args, "shrink on SmolLM2-135M", "scripts/bench_shrink.py", argv, args.device,
                                      args.threads)  # fmt: skip
    if begun is None:
        return 0
    info, result = begun
    base, tokenizer, model_info = load(args)
    length = 64 if args.quick else 512
    calib = list(stream("valid", tokenizer, args.calib_sequences * length).view(args.calib_sequences, length))
    test_ids = stream("test", tokenizer, args.eval_tokens)
    # Bench's reference cache keys on these settings; the rows measure through the same functions
    args.steps, args.batch, args.lr, args.score_batches = 0, 0, 0.0, 0
    bench = Bench(base, tokenizer, None, test_ids, calib, None, args, args.device)
    reference, cached = bench.reference()
    print(f"  unpruned: ppl {reference['ppl']:.2f}  last-word {acc_text(reference['lastword'])}"
          f"{'  (cached)' if cached else ''}", flush=True)  # fmt: skip
    lastword = bench.lastword
    rows, statistics = [], None
    for cut in args.cuts:
        model = copy.deepcopy(base).eval()
        start = time.perf_counter()
        found = sinv_prune.shrink(model, cut, calibration=calib, length=length, stock=args.stock,
                                  budget=args.budget, seed=args.seed, quiet=True, statistics=statistics,
                                  refine=args.refine, keep_statistics=True)  # fmt: skip
        seconds = time.perf_counter() - start
        statistics = statistics or found.statistics  # the same model and calibration: the next cut skips the pass
        print(found, flush=True)
        value = ppl(model, test_ids, args, args.device)
        acc = lastword(model)
        removed = 100 * found.removed / found.non_embedding
        share = ", ".join(f"{u} {100 * v / max(found.removed, 1):.0f}%" for u, v in found.shares.items())
        row = {"cut": cut, "removed_pct": round(removed, 2), "shares": found.shares, "ppl": value,
               "ratio": value / reference["ppl"], "lastword": acc, "seconds": round(seconds, 1),
               "search": found.to_dict()}  # fmt: skip
        rows.append(row)
        print(f"  {100 * cut:4.0f}% shrink{' --stock' if args.stock else ''}: removed {removed:.2f}% ({share}), "
              f"ppl {value:.2f} ({row['ratio']:.3f}x), last-word {acc_text(acc)}, {seconds:.0f} s, "
              f"kept {found.chosen} ({found.built})", flush=True)  # fmt: skip
        if args.save:
            target = f"{args.save}/shrink-{cut:g}{'-stock' if args.stock else ''}"
            model.save_pretrained(target)
            tokenizer.save_pretrained(target)
        del model
    print()
    print(common.table(["cut", "removed", "shares", "ppl", "ratio", "last-word", "search s"],
                       [[f"-{100 * r['cut']:g}%", f"{r['removed_pct']:.2f}%",
                         ", ".join(f"{u} {100 * v / max(sum(r['shares'].values()), 1):.0f}%"
                                   for u, v in r["shares"].items()),
                         f"{r['ppl']:.2f}", f"{r['ratio']:.3f}", acc_text(r["lastword"]), f"{r['seconds']:.0f}"]
                        for r in rows]))  # fmt: skip
    result.update(model=model_info, unpruned=reference, rows=rows)
    common.finish(info)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
