"""Compensation with ``target="residual"``: each refit reproduces the unpruned residual stream after its consumer."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import VOCAB, model_output, tiny_model
from test_compensation import calibration, run_hooked

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import head_rows

PLAN = {"heads": {0: [0, 3], 1: [1, 4]}, "mlp": {0: list(range(0, 64, 4)), 1: list(range(1, 64, 3))}}
RIDGE = 0.01


def _consumer(adapter, layer: int, unit: str):
    return adapter.out_proj(layer) if unit == "heads" else adapter.mlp_out(layer)


def _capture(model, layer: int, unit: str, batches) -> dict[str, torch.Tensor]:
    """The consumer's input and output rows and its residual norm's input rows over ``batches`` (float64)."""
    adapter = get_adapter(model)
    consumer = _consumer(adapter, layer, unit)
    norm = adapter.attention_residual_norm(layer) if unit == "heads" else adapter.mlp_residual_norm(layer)
    seen: dict[str, list] = {"x": [], "y": [], "base": []}

    def flat(t):
        return t.reshape(-1, t.shape[-1]).double()

    handles = [
        consumer.register_forward_pre_hook(lambda m, args: seen["x"].append(flat(args[0]))),
        consumer.register_forward_hook(lambda m, args, out: seen["y"].append(flat(out))),
        norm.register_forward_pre_hook(lambda m, args: seen["base"].append(flat(args[0]))),
    ]
    run_hooked(model, batches, handles)
    return {k: torch.cat(v) for k, v in seen.items()}


def _expected(reference, batches):
    """The plan pruned plainly, then each consumer in forward order refitted here by ridge least squares (pulled to
    its plain weights) to the unpruned residual stream after it, on the inputs the model refitted so far gives."""
    student = copy.deepcopy(reference)
    sinv_prune.prune(student, copy.deepcopy(PLAN))
    adapter = get_adapter(reference)
    for layer in (0, 1):
        for unit in ("heads", "mlp"):
            removed = PLAN[unit][layer]
            width = _consumer(adapter, layer, unit).weight.shape[1]
            gone = set(head_rows(torch.tensor(removed), 8).tolist()) if unit == "heads" else set(removed)
            kept = [c for c in range(width) if c not in gone]
            teacher, now = _capture(reference, layer, unit, batches), _capture(student, layer, unit, batches)
            x, y = now["x"], teacher["y"] + teacher["base"] - now["base"]
            plain = _consumer(adapter, layer, unit).weight.detach().double()[:, kept]
            gram = x.T @ x
            lam = RIDGE * gram.diagonal().mean()
            w = torch.linalg.solve(gram + lam * torch.eye(len(kept), dtype=gram.dtype), x.T @ y + lam * plain.T).T
            _consumer(get_adapter(student), layer, unit).weight.data.copy_(w.float())
    return student


def _block_error(model, reference, batches, layer: int) -> float:
    """Relative error of block ``layer``'s output against the unpruned model's, over ``batches``."""
    outs = []
    for m in (model, reference):
        seen = []
        block = get_adapter(m).layers()[layer]
        run_hooked(m, batches, [block.register_forward_hook(lambda *a, s=seen: s.append(a[2]))])
        outs.append(torch.cat([o[0] if isinstance(o, tuple) else o for o in seen]).double())
    return float((outs[0] - outs[1]).norm() / outs[1].norm())


def test_residual_refits_are_the_least_squares_fits_to_the_unpruned_stream_recomputed_here():
    reference, batches = tiny_model("llama"), calibration()
    pruned = {t: copy.deepcopy(reference) for t in ("output", "residual")}
    for target, model in pruned.items():
        summary = sinv_prune.prune(model, copy.deepcopy(PLAN), calibration=batches, compensate="lsq", ridge=RIDGE,
                                   holdout=0, target=target)  # fmt: skip
        assert summary.compensation.target == target and len(summary.compensation.layers) == 4
    expected = _expected(reference, batches)
    adapter, want = get_adapter(pruned["residual"]), get_adapter(expected)
    for layer in (0, 1):
        for unit in ("heads", "mlp"):
            torch.testing.assert_close(_consumer(adapter, layer, unit).weight, _consumer(want, layer, unit).weight,
                                       atol=1e-4, rtol=1e-4)  # fmt: skip
    probe = calibration(batches=1, seed=7)[0]
    torch.testing.assert_close(model_output(pruned["residual"], probe), model_output(expected, probe), atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    # the block after the second cut reproduces the unpruned block better than consumers fitted to their outputs
    errors = {t: _block_error(m, reference, batches, 1) for t, m in pruned.items()}
    assert errors["residual"] < errors["output"], errors


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("llama", {"target": "stream"}, "unknown compensation target 'stream'"),
        ("llama", {"target": "residual", "compensate": "bias", "add_bias": True}, "needs compensate='lsq' or 'obs'"),
        ("llama", {"target": "residual", "compensate": None, "calibration": None}, "needs compensate='lsq' or 'obs'"),
        ("gpt2", {"target": "residual"}, "needs pre-norm blocks (the LLaMA layout); gpt2 has none"),
        ("bert", {"target": "residual"}, "needs pre-norm blocks (the LLaMA layout); bert has none"),
    ],
)
def test_a_residual_target_that_cannot_apply_is_refused_before_anything_changes(arch, kwargs, message):
    model = tiny_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"calibration": calibration(), "compensate": "lsq", **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sinv_prune.prune(model, {"heads": {0: [1]}}, **options)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_moe_model_mixing_dense_layers_takes_the_residual_target_where_it_applies():
    # Qwen3-MoE, layer 1 dense between MoE layers: every layer's attention and the dense MLP refit to the stream
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, num_hidden_layers=3, hidden_size=32, head_dim=8,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=24,
                                         mlp_only_layers=[1], bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference, batches = transformers.Qwen3MoeForCausalLM(config).eval(), calibration()
    adapter = get_adapter(reference)
    norms = [f(i) for i in range(3) for f in (adapter.attention_residual_norm, adapter.mlp_residual_norm)]
    assert [n is not None for n in norms] == [True, False, True, True, True, False]
    plan = {"heads": {0: [1, 3], 1: [0, 2], 2: [0, 3]}, "mlp": {1: list(range(0, 24, 3))}}
    pruned = {}
    for target in ("output", "residual"):
        pruned[target] = copy.deepcopy(reference)
        summary = sinv_prune.prune(pruned[target], copy.deepcopy(plan), calibration=batches, compensate="obs",
                                   ridge=RIDGE, holdout=0, target=target)  # fmt: skip
        assert len(summary.compensation.layers) == 4 and summary.compensation.target == target
    weights = {t: [get_adapter(m).out_proj(i).weight for i in range(3)] for t, m in pruned.items()}
    torch.testing.assert_close(weights["residual"][0], weights["output"][0])  # nothing before the first cut
    assert not torch.allclose(weights["residual"][2], weights["output"][2])  # the stream's error taken up
    errors = {t: _block_error(m, reference, batches, 2) for t, m in pruned.items()}
    assert errors["residual"] < errors["output"], errors
