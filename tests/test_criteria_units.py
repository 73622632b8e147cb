"""Criteria for every unit: MLP channels and whole layers (heads are covered by test_criteria.py)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import model_inputs, model_output, tiny_model

from sinv_prune import channel_gates, get_adapter, head_measures, prune_heads, select_layers
from sinv_prune.arch.base import linear_weight
from sinv_prune.scoring.criteria import (
    BlockInfluenceCriterion,
    Criterion,
    MagnitudeCriterion,
    available_criteria,
    criterion_class,
    get_criterion,
)
from sinv_prune.scoring.criteria.base import frozen_parameters

EXPECTED_UNITS = {
    "random": ("heads", "mlp", "experts", "layers"),
    "magnitude": ("heads", "mlp", "experts"),
    "taylor": ("heads", "mlp", "experts"),
    "activation": ("heads", "mlp"),
    "entropy": ("heads",),
    "sinv_static": ("heads", "experts"),
    "sinv_gauge": ("heads",),
    "sinv_early": ("heads", "experts"),
    "frequency": ("experts",),
    "reap": ("experts",),
    "ean": ("experts",),
    "block_influence": ("layers",),
    "sinv_depth": ("layers",),
}
MLP_CRITERIA = [name for name, units in EXPECTED_UNITS.items() if "mlp" in units]
LAYER_CRITERIA = [name for name, units in EXPECTED_UNITS.items() if "layers" in units]


def batches(n: int = 2) -> list[dict]:
    return [model_inputs(seed) for seed in range(n)]


# -- the contract -------------------------------------------------------------------------


def test_units_of_every_builtin_criterion():
    assert set(EXPECTED_UNITS) <= set(available_criteria())
    assert {name: criterion_class(name).units for name in EXPECTED_UNITS} == EXPECTED_UNITS
    assert Criterion.units == ("heads",) and get_criterion("random").unit == "heads"
    assert get_criterion("magnitude", unit="mlp", p=1).unit == "mlp"
    with pytest.raises(ValueError, match=r"criterion 'entropy' does not score 'mlp'; it scores: heads"):
        get_criterion("entropy", unit="mlp")
    with pytest.raises(ValueError, match=r"does not score 'layers'; it scores: heads, mlp"):
        get_criterion("taylor", unit="layers")
    with pytest.raises(ValueError, match="does not accept option"):
        get_criterion("block_influence", unit="layers", seed=1)


@pytest.mark.parametrize("which", ["gpt2", "bert", "llama"])
def test_shapes_and_finiteness(which):
    model = tiny_model(which)
    adapter = get_adapter(model)
    sizes = [adapter.intermediate_size(layer) for layer in range(adapter.num_layers)]
    for name in MLP_CRITERIA:
        scores = get_criterion(name, unit="mlp").compute(model, batches())
        assert [len(row) for row in scores] == sizes, name
        assert all(math.isfinite(x) for row in scores for x in row), name
    for name in LAYER_CRITERIA:
        scores = get_criterion(name, unit="layers").compute(model, batches())
        assert len(scores) == adapter.num_layers and all(isinstance(x, float) and math.isfinite(x) for x in scores)


def test_random_channels_and_layers_are_seeded():
    model = tiny_model("llama")
    for unit in ("mlp", "layers"):
        a, b = (get_criterion("random", unit=unit, seed=s).compute(model) for s in (1, 1))
        assert a == b and a != get_criterion("random", unit=unit, seed=2).compute(model)
    heads = get_criterion("random", seed=1).compute(model)
    assert [len(r) for r in heads] == [6, 6, 6]


# -- channel criteria ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_magnitude_channels_equal_the_norm_of_their_weights(which):
    model = tiny_model(which)
    adapter = get_adapter(model)
    layer, channel = 1, 5
    with torch.no_grad():
        for module in adapter.mlp_in(layer):
            linear_weight(module)[channel].zero_()
        linear_weight(adapter.mlp_out(layer))[:, channel].zero_()
    for p in (1, 2):
        scores = get_criterion("magnitude", unit="mlp", p=p).compute(model)
        rows = torch.cat([linear_weight(m).detach() for m in adapter.mlp_in(0)], dim=1)  # [I, D * len(mlp_in)]
        full = torch.cat([rows, linear_weight(adapter.mlp_out(0)).detach().t()], dim=1)
        expected = full.norm(p=p, dim=1).double()
        torch.testing.assert_close(torch.tensor(scores[0], dtype=torch.float64), expected, rtol=1e-5, atol=1e-6)
        assert scores[layer][channel] == 0.0 and min(scores[layer]) == 0.0
        assert sorted(range(len(scores[layer])), key=scores[layer].__getitem__)[0] == channel
    assert len(adapter.mlp_in(0)) == (2 if which == "llama" else 1)  # gate and up both count in LLaMA


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_channel_gate_zero_is_removing_the_channel(which):
    model = tiny_model(which)
    adapter = get_adapter(model)
    inputs = model_inputs(3)
    with channel_gates(model, requires_grad=False) as gates:
        assert [g.numel() for g in gates] == [adapter.intermediate_size(i) for i in range(adapter.num_layers)]
        gates[2][[0, 7]] = 0.0
        gated = model_output(model, inputs)
    with torch.no_grad():
        linear_weight(adapter.mlp_out(2))[:, [0, 7]] = 0.0
    torch.testing.assert_close(gated, model_output(model, inputs))


def test_taylor_channels_equal_finite_differences():
    """|dL/d gate_j| per batch, summed over batches (normalize=False), matches central differences in float64.

    GPT-2: LLaMA's RMSNorm computes in float32 whatever the model dtype, too coarse for differences.
    """
    model = tiny_model("gpt2").double()
    data = batches(2)

    def loss_fn(m, batch):  # float64 throughout (the model's own loss casts logits to float32)
        logits = m(**batch).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
        )

    scores = get_criterion("taylor", unit="mlp", normalize=False, loss_fn=loss_fn).compute(model, data)
    eps = 2.0**-8  # exact in the float32 gates
    for layer, channel in [(0, 3), (2, 40), (1, 127)]:
        expected = 0.0
        for batch in data:
            losses = []
            for sign in (1, -1):
                with channel_gates(model, requires_grad=False) as gates, torch.no_grad():
                    gates[layer][channel] = 1 + sign * eps
                    losses.append(loss_fn(model, batch).item())
            expected += abs(losses[0] - losses[1]) / (2 * eps)
        assert scores[layer][channel] == pytest.approx(expected, rel=1e-6) and expected > 0
    normalized = get_criterion("taylor", unit="mlp").compute(model, data)
    assert all(math.isclose(sum(x * x for x in row), 1.0, rel_tol=1e-5) for row in normalized)


@pytest.mark.parametrize("unit", ["heads", "mlp"])
def test_taylor_freezes_weights_while_scoring_and_restores_flags(unit):
    model = tiny_model("gpt2")
    frozen_before = {name for name, p in model.named_parameters() if "wte" in name}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen_before)
    seen = []

    def loss_fn(m, batch):
        seen.append(any(p.requires_grad for p in m.parameters()))
        return m(**batch, labels=batch["input_ids"]).loss

    scores = get_criterion("taylor", unit=unit, loss_fn=loss_fn).compute(model, batches())
    assert seen == [False, False]  # no weight needed a gradient during the passes
    assert any(x > 0 for row in scores for x in row)
    assert all(p.grad is None for p in model.parameters())
    assert {name for name, p in model.named_parameters() if not p.requires_grad} == frozen_before


def test_frozen_parameters_restores_flags_on_error():
    model = tiny_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)
    with pytest.raises(RuntimeError), frozen_parameters(model):
        assert not any(p.requires_grad for p in model.parameters())
        raise RuntimeError
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["transformer.wpe.weight"]


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_activation_channels_wanda_equals_manual(which):
    """metric=magnitude: mean |x_j| over non-padding tokens at the down projection's input x column norm."""
    model = tiny_model(which)
    adapter = get_adapter(model)
    data = batches(2)
    data[1]["attention_mask"] = torch.ones_like(data[1]["input_ids"])
    data[1]["attention_mask"][0, 6:] = 0
    captured = {}
    hook = adapter.mlp_out(1).register_forward_pre_hook(lambda m, a: captured.setdefault(len(captured), a[0].detach()))
    try:
        with torch.no_grad():
            for batch in data:
                model(**batch)
    finally:
        hook.remove()
    valid = [captured[0].reshape(-1, captured[0].shape[-1]), captured[1][data[1]["attention_mask"] != 0]]
    tokens = torch.cat(valid).double()
    column = linear_weight(adapter.mlp_out(1)).detach().double().norm(dim=0)
    criterion = get_criterion("activation", unit="mlp", metric="magnitude")
    scores = criterion.compute(model, data)
    torch.testing.assert_close(torch.tensor(scores[1], dtype=torch.float64), tokens.abs().mean(0) * column)
    assert criterion.report()["tokens"] == tokens.shape[0] == 18 + 15
    fluctuation = get_criterion("activation", unit="mlp").compute(model, data)
    expected = tokens.var(0, unbiased=False) * column.square()
    torch.testing.assert_close(torch.tensor(fluctuation[1], dtype=torch.float64), expected)


# -- layer criteria -----------------------------------------------------------------------


def make_identity(model, layer: int) -> None:
    """Zero the attention output and MLP down projections (and biases) of ``layer``: the block is the identity."""
    adapter = get_adapter(model)
    with torch.no_grad():
        for module in (adapter.out_proj(layer), adapter.mlp_out(layer)):
            module.weight.zero_()
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_block_influence_of_an_identity_block_is_zero_and_lowest(which):
    model = tiny_model(which)
    make_identity(model, 1)
    criterion = get_criterion("block_influence", unit="layers")
    scores = criterion.compute(model, batches())
    assert abs(scores[1]) < 1e-6 and min(scores[0], scores[2]) > 1e-3
    assert select_layers(scores, 1) == [1]
    assert criterion.report() == {"batches": 2, "tokens": 36}


def test_block_influence_excludes_padding():
    """Right padding under a causal mask: the scores equal those of the unpadded tokens alone."""
    model = tiny_model("llama")
    ids = model_inputs(0, batch=1, length=9)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    padded = get_criterion("block_influence", unit="layers").compute(
        model, [{"input_ids": ids, "attention_mask": mask}]
    )
    alone = get_criterion("block_influence", unit="layers").compute(model, [{"input_ids": ids[:, :6]}])
    unmasked = get_criterion("block_influence", unit="layers").compute(model, [{"input_ids": ids}])
    assert padded == pytest.approx(alone, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(padded, unmasked, strict=True)) > 1e-4


def test_sinv_depth_is_minus_cff_over_mean_cq_and_prunes_the_highest_ratio_first():
    model = tiny_model("llama")
    measures = head_measures(model, keys=["C_Q", "C_FF"])
    ratio = [c_ff / (sum(row) / len(row)) for row, c_ff in zip(measures["C_Q"], measures["C_FF"], strict=True)]
    criterion = get_criterion("sinv_depth", unit="layers")
    scores = criterion.compute(model)
    assert scores == pytest.approx([-r for r in ratio], rel=1e-12)
    assert criterion.report()["ratio"] == pytest.approx(ratio)
    assert select_layers(scores, 1) == [max(range(3), key=ratio.__getitem__)]  # most "undertrained" first
    assert get_criterion("sinv_depth", unit="layers", invert=True).compute(model) == pytest.approx(ratio)
    assert select_layers(get_criterion("sinv_depth", unit="layers", invert=True).compute(model), 1) == [
        min(range(3), key=ratio.__getitem__)
    ]


def test_sinv_depth_layer_without_heads_uses_the_model_mean():
    model = tiny_model("gpt2")
    prune_heads(model, {1: [0, 1, 2, 3]}, allow_empty_layers=True)
    measures = head_measures(model, keys=["C_Q", "C_FF"])
    every = [x for row in measures["C_Q"] for x in row]
    scores = get_criterion("sinv_depth", unit="layers").compute(model)
    assert scores[1] == pytest.approx(-measures["C_FF"][1] / (sum(every) / len(every)))


def test_an_instance_built_directly_scores_its_first_unit():
    model = tiny_model("gpt2")
    assert MagnitudeCriterion().unit == "heads"
    assert MagnitudeCriterion().compute(model) == get_criterion("magnitude").compute(model)
    assert BlockInfluenceCriterion().unit == "layers"
    criterion = MagnitudeCriterion()
    criterion.unit = "mlp"
    assert [len(r) for r in criterion.compute(model)] == [128] * 3 and "unit='mlp'" in repr(criterion)
    with pytest.raises(ValueError, match="criterion 'magnitude' does not score 'layers'; it scores: heads, mlp"):
        criterion.unit = "layers"
