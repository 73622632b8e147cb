"""Did a refactor change behaviour? A handful of pruning setups on tiny random models, hashed bit for bit.

Written against the public API only (names imported from ``sinv_prune`` itself: ``prune``, ``Pruner`` /
``Part``, ``shrink``, ``select_heads`` / ``select_channels`` / ``select_layers``, ``head_gates`` /
``channel_gates``, ``from_pretrained``, ``count_parameters``), so the same script runs before and after a change
of the package layout (issue 36) and its digests must agree. Each setup builds its tiny random model and its
calibration ids in-process from fixed seeds (no downloads), prunes, and hashes (sha256) five parts:

* ``plan``: what was removed (``Pruner.last_selection`` or the plan given / chosen), as sorted JSON;
* ``weights``: every state_dict tensor of the pruned model (name, shape, dtype, bytes);
* ``record``: the ``PruneSummary`` / ``ShrinkResult`` / ``Pruner.report()`` and the model's config (which
  holds the pruning record), as JSON with sorted keys, times left out;
* ``logits``: the pruned model's logits on a fixed input;
* ``reload``: the files ``save_pretrained`` writes and the logits of ``sinv_prune.from_pretrained`` on them.

Setups (LLaMA: 8 query heads in 2 KV groups; Qwen2-MoE: 6 experts, top 2, a shared expert, layer 1 dense):

* ``heads-taylor-obs``: LLaMA, a quarter of the heads by ``taylor``, ``compensate="obs"`` (the held-out guard);
* ``heads-mlp-magnitude-lsq``: LLaMA, uniform ``magnitude`` heads and MLP channels, ``compensate="lsq"`` with no
  held-out sequences (refits kept), reloads on the stock class;
* ``layers-block-influence``: GPT-2, 2 blocks by ``block_influence`` and 4 ``entropy`` heads in 2 rounds;
* ``experts-reap-mlp``: Qwen2-MoE, one expert per MoE layer by ``reap`` and a quarter of the MLP channels (dense
  layer, routed and shared experts) by ``magnitude``;
* ``experts-taylor-sensitivity``: Qwen2-MoE, 3 experts by ``taylor`` spread by the ``sensitivity`` allocation;
* ``plan-direct``: Qwen2-MoE, one explicit ``prune`` plan of heads, channels and experts, then a block;
* ``selection-gates``: LLaMA, ``select_heads`` / ``select_channels`` / ``select_layers`` on seeded scores (ties
  included), ``head_gates`` / ``channel_gates`` gradients (in the record), the selection pruned;
* ``shrink`` (LLaMA, 4 layers) and ``shrink-moe`` (Qwen2-MoE): a 30% / 25% cut, budget 6, 16 short sequences.

One thread, deterministic algorithms; under 10 s on one CPU core. The first line names the ``sinv_prune``
imported (``PYTHONPATH`` first, else the installed one) and its git commit: that is the code compared.

    python scripts/compare_refactor.py --json before.json                  # on the base commit
    python scripts/compare_refactor.py --against before.json               # after: exit 1 naming what differs
    PYTHONPATH=/path/to/worktree python scripts/compare_refactor.py ...    # another checkout's sinv_prune
    python scripts/compare_refactor.py --only shrink --dump d              # one setup; its JSON, to diff
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import sinv_prune  # noqa: E402

VOCAB = 96
PARTS = ("plan", "weights", "record", "logits", "reload")
#: Keys whose values are wall-clock times (or derived from them): left out of the record.
VOLATILE = {"seconds", "us_per_token", "elapsed", "elapsed_s", "time_s"}
#: The fixed input every pruned model's logits are taken on.
PROBE = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1234))


def calibration_ids(n: int = 8, length: int = 24, seed: int = 1) -> list[torch.Tensor]:
    """``n`` random id sequences (one tensor each)."""
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(2, VOCAB, (n, length), generator=g))


def batches(n: int = 4, length: int = 24, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Calibration batches of two sequences, as the criteria and compensation take them."""
    ids = calibration_ids(2 * n, length, seed)
    return [{"input_ids": torch.stack(ids[i : i + 2])} for i in range(0, len(ids), 2)]


def _finish(model: transformers.PreTrainedModel, seed: int) -> transformers.PreTrainedModel:
    """Eager attention, eval mode, and random biases (so that bias slicing shows in the outputs)."""
    model.config._attn_implementation = "eager"
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def tiny_llama(seed: int = 0, layers: int = 3) -> transformers.PreTrainedModel:
    """A tiny random LLaMA with GQA: 8 query heads in 2 KV groups of head_dim 8, MLP width 96."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return _finish(transformers.LlamaForCausalLM(config), seed)


def tiny_gpt2(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random GPT-2: 4 blocks of 4 heads, width 32."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=32, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return _finish(transformers.GPT2LMHeadModel(config), seed)


def tiny_qwen2_moe(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random Qwen2-MoE: 3 layers, layer 1 dense; 6 experts of width 16 (top 2) and a shared expert."""
    config = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                                         moe_intermediate_size=16, intermediate_size=24,
                                         shared_expert_intermediate_size=24, num_experts=6, mlp_only_layers=[1],
                                         bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # spread routers and experts more than the default init does
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return _finish(model, seed)


#: What a setup returns: the pruned model, what was removed (the plan) and the record, both JSON-like.
Result = tuple[transformers.PreTrainedModel, Any, dict]
#: One setup: builds its model from fixed seeds and prunes it.
Setup = Callable[[], Result]


def _pruner_run(
    model: transformers.PreTrainedModel,
    parts: list[sinv_prune.Part],
    *,
    compensate: str | None = None,
    options: dict | None = None,
    rounds: int = 1,
    calibration: bool = False,
) -> Result:
    """``Pruner(parts).prune`` with the calibration batches as ``batches`` (and ``calibration`` where asked)."""
    pruner = sinv_prune.Pruner(parts, compensate=compensate, compensation_options=options, rounds=rounds, quiet=True)
    cal = batches()
    summary = pruner.prune(model, batches=cal, calibration=cal if (compensate or calibration) else None)
    record = {"summary": summary.to_dict(), "report": pruner.report()}
    return model, pruner.last_selection, record


def heads_taylor_obs() -> Result:
    parts = [sinv_prune.Part("heads", "taylor", 0.25)]
    return _pruner_run(tiny_llama(), parts, compensate="obs")


def heads_mlp_magnitude_lsq() -> Result:
    # uniform cuts (2 query heads per KV group, a quarter of every MLP) reload on the stock class; no held-out
    # sequences, so the refits are kept (the held-out guard runs in heads-taylor-obs)
    parts = [sinv_prune.Part("heads", "magnitude", 12, mode="uniform"),
             sinv_prune.Part("mlp", "magnitude", 0.25, mode="uniform", multiple=8)]  # fmt: skip
    return _pruner_run(tiny_llama(), parts, compensate="lsq", options={"holdout": 0})


def layers_block_influence() -> Result:
    parts = [sinv_prune.Part("layers", "block_influence", 2), sinv_prune.Part("heads", "entropy", 4)]
    return _pruner_run(tiny_gpt2(), parts, rounds=2)


def experts_reap_mlp() -> Result:
    parts = [sinv_prune.Part("experts", "reap", 2), sinv_prune.Part("mlp", "magnitude", 0.25)]
    return _pruner_run(tiny_qwen2_moe(), parts)


def experts_taylor_sensitivity() -> Result:
    parts = [sinv_prune.Part("experts", "taylor", 3, allocation="sensitivity")]
    return _pruner_run(tiny_qwen2_moe(), parts, calibration=True)


def plan_direct() -> Result:
    model = tiny_qwen2_moe()
    plan = {"heads": {0: [1, 3]}, "mlp": {1: list(range(0, 24, 3))}, "experts": {0: [2], 2: [0, 5]}, "layers": []}
    summary = sinv_prune.prune(model, plan)
    plan2 = {"layers": [1]}
    summary2 = sinv_prune.prune(model, plan2)  # composes: the dense layer goes after its channels
    return model, [plan, plan2], {"summary": [summary.to_dict(), summary2.to_dict()]}


def selection_gates() -> Result:
    """The selection functions and gates on their own (seeded random scores; tied layer scores), then ``prune``."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(7)
    head_scores = torch.rand(3, 8, generator=g).round(decimals=1).tolist()  # ties: the seed orders them
    channel_scores = torch.rand(3, 96, generator=g).tolist()
    heads = sinv_prune.select_heads(head_scores, 0.3, layouts=model, layout="auto", min_heads_per_layer=2, seed=3)
    channels = sinv_prune.select_channels(model, channel_scores, 0.2, mode="per_layer", multiple=8, seed=3)
    layers = sinv_prune.select_layers([0.5, 0.25, 0.25, 0.25, 0.9, 0.25, 0.25, 0.75], 3, seed=3)  # scores only
    batch = batches(1)[0]
    with sinv_prune.head_gates(model) as hg, sinv_prune.channel_gates(model) as cg:
        model(**batch, labels=batch["input_ids"]).loss.backward()
        grads = {"heads": [t.grad for t in hg], "mlp": [t.grad for t in cg]}
    model.zero_grad(set_to_none=True)
    plan = {"heads": heads, "mlp": channels}
    summary = sinv_prune.prune(model, plan)
    return model, {**plan, "layers": layers}, {"summary": summary.to_dict(), "gate_grads": grads}


def shrink_moe() -> Result:
    model = tiny_qwen2_moe()
    result = sinv_prune.shrink(model, 0.25, calibration=calibration_ids(16, 24), sequences=16, length=24, budget=6,
                               multiple=4, fitness_sequences=2, fitness_tokens=24, seed=0, quiet=True)  # fmt: skip
    return model, result.plan, {"result": result.to_dict()}


def shrink_small() -> Result:
    model = tiny_llama(layers=4)
    result = sinv_prune.shrink(model, 0.3, calibration=calibration_ids(16, 32), sequences=16, length=32, budget=6,
                               multiple=8, fitness_sequences=2, fitness_tokens=32, seed=0, quiet=True)  # fmt: skip
    return model, result.plan, {"result": result.to_dict()}


SETUPS: dict[str, Setup] = {
    "heads-taylor-obs": heads_taylor_obs,
    "heads-mlp-magnitude-lsq": heads_mlp_magnitude_lsq,
    "layers-block-influence": layers_block_influence,
    "experts-reap-mlp": experts_reap_mlp,
    "experts-taylor-sensitivity": experts_taylor_sensitivity,
    "plan-direct": plan_direct,
    "selection-gates": selection_gates,
    "shrink": shrink_small,
    "shrink-moe": shrink_moe,
}


def normalise(value: Any) -> Any:
    """JSON-ready: string keys, tuples as lists, tensors as lists, times (``VOLATILE`` keys) left out."""
    if isinstance(value, dict):
        return {str(k): normalise(v) for k, v in value.items() if str(k) not in VOLATILE}
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return repr(value)


def json_bytes(value: Any) -> bytes:
    """``value`` normalised, as JSON with sorted keys."""
    return json.dumps(normalise(value), sort_keys=True, allow_nan=True).encode()


def tensor_digest(h: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed ``h`` (a hashlib hash) the tensor's name, shape, dtype and bytes."""
    t = tensor.detach().cpu().contiguous()
    h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def logits_of(model: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def digest_setup(name: str, dump: Path | None) -> dict:
    """Run one setup and hash its parts; returns ``{"params", "parts": {part: sha256}, "digest", "seconds"}``."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model, plan, record = SETUPS[name]()
    parts: dict[str, str] = {}
    parts["plan"] = hashlib.sha256(json_bytes(plan)).hexdigest()
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        tensor_digest(h, key, tensor)
    parts["weights"] = h.hexdigest()
    config = json.loads(model.config.to_json_string(use_diff=False))
    parts["record"] = hashlib.sha256(json_bytes({"record": record, "config": config})).hexdigest()
    h = hashlib.sha256()
    tensor_digest(h, "logits", logits_of(model))
    parts["logits"] = h.hexdigest()
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        for path in files:
            h.update(f"{path.relative_to(tmp)}|".encode() + hashlib.sha256(path.read_bytes()).digest())
        reloaded = sinv_prune.from_pretrained(tmp).eval()
        reloaded.config._attn_implementation = "eager"
        tensor_digest(h, "reloaded", logits_of(reloaded))
        saved = [str(p.relative_to(tmp)) for p in files]
    parts["reload"] = h.hexdigest()
    digest = hashlib.sha256("".join(f"{k}={parts[k]};" for k in PARTS).encode()).hexdigest()
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        weights = {}
        for key, tensor in sorted(model.state_dict().items()):
            one = hashlib.sha256()
            tensor_digest(one, key, tensor)
            weights[key] = f"{tuple(tensor.shape)} {tensor.dtype} {one.hexdigest()[:16]}"
        text = json.dumps(normalise({"plan": plan, "record": record, "config": config, "weights": weights,
                                     "saved": saved, "parts": parts}), sort_keys=True, indent=1)  # fmt: skip
        (dump / f"{name}.json").write_text(text + "\n")
    params = sinv_prune.count_parameters(model)
    return {"params": params, "parts": parts, "digest": digest, "seconds": round(time.perf_counter() - start, 2)}


def combined(results: dict[str, dict]) -> str:
    """One digest over every setup's, by setup name."""
    return hashlib.sha256("".join(f"{k}={results[k]['digest']};" for k in sorted(results)).encode()).hexdigest()


def source() -> str:
    """Where ``sinv_prune`` was imported from, with its git commit (and ``+dirty``) when it is a checkout."""
    root = Path(sinv_prune.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "sinv_prune"],
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        return f"{root} @ {commit}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return str(root)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the per-setup digests here")
    ap.add_argument("--against", type=Path, help="compare with an earlier --json; exit 1 naming the setups that differ")
    ap.add_argument(
        "--only", nargs="+", choices=list(SETUPS), metavar="SETUP", help="run these setups only: " + ", ".join(SETUPS)
    )
    ap.add_argument("--dump", type=Path, help="write each setup's normalised plan, record, config and weight hashes")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        names = args.only or list(SETUPS)
        print(f"sinv_prune {sinv_prune.__version__} from {source()}")
        print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread")
        results = {name: digest_setup(name, args.dump) for name in names}
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        transformers.logging.set_verbosity(verbosity)
    earlier = json.loads(args.against.read_text())["setups"] if args.against else {}
    width = max(len(n) for n in names)
    print(f"\n| {'setup':<{width}} | params after | sha256 (16)      |" + (" against |" if earlier else ""))
    print(f"|:{'-' * width}-|-------------:|:-----------------|" + (":--------|" if earlier else ""))
    differ = []
    for name, r in results.items():
        line = f"| {name:<{width}} | {r['params']:>12,} | {r['digest'][:16]} |"
        if earlier:
            before = earlier.get(name)
            if before is None:
                verdict = "not in --against"
                differ.append(name)
            elif before["digest"] == r["digest"]:
                verdict = "same"
            else:
                verdict = "DIFFERS: " + ", ".join(p for p in PARTS if before["parts"].get(p) != r["parts"][p])
                differ.append(name)
            line += f" {verdict} |"
        print(line)
    total = combined(results)
    print(f"\ncombined digest ({len(results)} setups): {total}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"source": source(), "torch": torch.__version__, "transformers": transformers.__version__,
                "combined": total, "setups": results}  # fmt: skip
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if earlier:
        if differ:
            print(f"DIFFERENT from {args.against}: {', '.join(differ)}")
            return 1
        print(f"same as {args.against} (all {len(results)} setups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
