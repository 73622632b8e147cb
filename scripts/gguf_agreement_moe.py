"""How closely llama.cpp reproduces transformers on mixture-of-experts models: the MoE rows of docs/deploy.md.

No pretrained MoE model small enough for this machine ships in a package, so each family
(Qwen3-MoE -> ``qwen3moe``, Qwen2-MoE -> ``qwen2moe``, Mixtral -> ``llama``, OLMoE -> ``olmoe``) is a
small seeded random model: hidden 256, 4 layers, 8 heads of 32 (4 KV heads; OLMoE 8, its llama.cpp
loader has no GQA), 8 experts of width 128, top-2 (Qwen2-MoE adds a shared expert of width 256),
vocabulary 1024, norm weights drawn from U(0.5, 1.5). Each is exported unpruned and after a uniform
expert cut (``--cut`` experts of every layer, chosen by seed) at each ``--types`` type, and evaluated
by llama.cpp (float32 KV cache, plain CPU buffers, as ``export_gguf``'s check loads it) on the 24
seeded random ids the check uses without a tokenizer and on ``--tokens`` further seeded random ids.
Per row: the median and worst position's logit difference relative to that position's largest logit,
and top-1 agreement. ``--perturb`` adds two float32 rows per family that the round-trip rule must
catch, compared with the unchanged model: layer 1's experts' down projections off by seeded noise of
1e-4 of each weight's size, and experts 0 and 1 of that tensor swapped.

    python scripts/gguf_agreement_moe.py --perturb --json gguf_agreement_moe.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from _bench_common import command_line, finish, machine, print_header, seed_everything, set_threads, table, write_json

import sinv_prune
from sinv_prune.deploy import gguf_verify

SHAPE = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=512, bos_token_id=0, eos_token_id=0, num_experts_per_tok=2)  # fmt: skip
FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=32, moe_intermediate_size=128, num_experts=8, norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=8)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=128, num_local_experts=8)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=128, num_experts=8, num_key_value_heads=8)),
}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    p.add_argument("--types", default="f32,f16,q8_0", help="GGUF types, comma-separated")
    p.add_argument("--cut", type=int, default=4, help="experts removed from every layer in the uniform cut")
    p.add_argument("--tokens", type=int, default=256, help="length of the second (seeded random) input")
    p.add_argument("--perturb", action="store_true", help="also float32 files with one expert tensor off")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def build(family: str, seed: int) -> transformers.PreTrainedModel:
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SHAPE, **kwargs})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llm = gguf_verify.load_llama(path, n_ctx=max(64, len(ids)))
    try:
        return gguf_verify.llama_logits(llm, ids)
    finally:
        llm.close()


def row(family, model_name, type_, arch, inputs, reference_model, path) -> list[dict]:
    out, mib = [], path.stat().st_size / 2**20
    for input_name, ids in inputs.items():
        res = gguf_verify.compare(gguf_verify.reference_logits(reference_model, ids), llama_cpp_logits(path, ids),
                                  exact_type=True, rtol=gguf_verify.tolerance(arch)[0],
                                  worst_rtol=gguf_verify.tolerance(arch)[1])  # fmt: skip
        out.append({"family": family, "model": model_name, "type": type_, "arch": arch, "MiB": mib,
                    "input": input_name, "tokens": res.tokens, "median": res.median_rel_diff,
                    "worst": res.max_rel_diff, "top1": res.top1_agreement,
                    "f32 rule": ("pass" if res.passed else "FAIL") if type_ == "f32" else ""})  # fmt: skip
        print(f"{family} {model_name} {type_} ({arch}) {input_name}: median {res.median_rel_diff:.2e} worst "
              f"{res.max_rel_diff:.2e} top-1 {res.top1_agreement:.1%} {out[-1]['f32 rule']}", flush=True)  # fmt: skip
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    seed_everything(args.seed)
    info = machine("cpu")
    command = command_line(__file__, argv)
    print_header("llama.cpp vs transformers on mixture-of-experts models", command, info)
    result = {"command": command, "machine": info,
              "settings": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}}  # fmt: skip
    rng = np.random.default_rng(args.seed)
    inputs = {
        "random ids": gguf_verify.prompt_ids(None, SHAPE["vocab_size"]),  # the check's input without a tokenizer
        f"{args.tokens} random ids": rng.integers(0, SHAPE["vocab_size"], size=args.tokens).tolist(),
    }
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model = build(family, args.seed)
            n = model.config.num_hidden_layers
            experts = torch.Generator().manual_seed(args.seed)
            cut = copy.deepcopy(model)
            count = model.model.layers[0].mlp.experts.gate_up_proj.shape[0]
            plan = {i: sorted(torch.randperm(count, generator=experts)[: args.cut].tolist()) for i in range(n)}
            sinv_prune.prune(cut, {"experts": plan})
            for name, m in (("unpruned", model), (f"uniform cut ({count - args.cut} of {count} experts)", cut)):
                for type_ in args.types.split(","):
                    path = Path(tmp) / f"{family}-{type_}.gguf"
                    out = sinv_prune.export_gguf(m, None, path, type=type_, verify=False, vocab=False)
                    rows += row(family, name, type_, out.arch, inputs, m, path)
                    path.unlink()
            if args.perturb:
                for label, change in (("layer 1's expert down projections off by 1e-4", "noise"),
                                      ("layer 1's experts 0 and 1 swapped in down_proj", "swap")):  # fmt: skip
                    off = copy.deepcopy(model)
                    with torch.no_grad():
                        w = off.model.layers[1].mlp.experts.down_proj
                        if change == "noise":
                            noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(args.seed))
                            w.add_(1e-4 * w.abs() * noise)
                        else:
                            w.copy_(w[[1, 0, *range(2, w.shape[0])]])
                    path = Path(tmp) / f"{family}-off.gguf"
                    out = sinv_prune.export_gguf(off, None, path, type="f32", verify=False, vocab=False)
                    rows += row(family, f"unpruned, {label}", "f32", out.arch, inputs, model, path)
                    path.unlink()
    print()
    headers = ["family", "model", "type", "llama.cpp arch", "MiB", "input", "tokens", "median rel. diff",
               "worst rel. diff", "top-1", "f32 rule"]  # fmt: skip
    print(table(headers, [[r["family"], r["model"], r["type"], r["arch"], f"{r['MiB']:.1f}", r["input"], r["tokens"],
                           f"{r['median']:.1e}", f"{r['worst']:.1e}", f"{r['top1']:.1%}", r["f32 rule"]] for r in rows],
                align="llllrlrrrrl"))  # fmt: skip
    rule = gguf_verify.tolerance("qwen3moe")
    print(
        f"\nfloat32 rule (llama, qwen3moe, qwen2moe, olmoe): median <= {rule[0]:g}, worst <= {rule[1]:g}, same arg-max"
    )
    result["rows"] = rows
    finish(info)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
