"""Compensation's guard (held-out tokens), mixed layer types, statistics precision and the ridge default."""

from __future__ import annotations

import copy
from typing import get_args

import pytest
import torch
import torch.nn.functional as F
from conftest import model_inputs, model_output, tiny_model
from test_compensation import calibration, make_redundant

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.surgery.block_inputs import capture_block_inputs, mark_heldout
from sinv_prune.surgery.compensation import RIDGES, TARGETS, default_ridge
from sinv_prune.surgery.refit import ConsumerFit

# -- models mixing sliding-window and full attention ---------------------------------------------------


def sliding_qwen2():
    """Qwen2 with layer 0 full attention and layers 1-2 sliding (window 4): blocks get different masks."""
    return tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)


def test_each_block_gets_its_own_mask():
    model = sliding_qwen2()
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    (inp,) = capture_block_inputs(model, get_adapter(model), [model_inputs(length=12)], holdout=0)
    masks = [kwargs["attention_mask"] for _, kwargs in inp.blocks]
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[1], masks[2])
    # run block by block on the caught inputs: the model's own hidden states
    hidden = inp.hidden
    for index, block in enumerate(get_adapter(model).layers()):
        hidden = inp.run(block, index, hidden)
    with torch.no_grad():
        expected = model.model(**model_inputs(length=12)).last_hidden_state
    torch.testing.assert_close(model.model.norm(hidden), expected)


def test_lsq_on_mixed_layer_types_reproduces_redundant_heads():
    model = sliding_qwen2()
    copies = {1: {0: 1, 2: 3, 4: 5}, 2: {1: 0}}  # removed head <- the kept head of its KV group it copies
    for layer, pairs in copies.items():
        for head, source in pairs.items():
            make_redundant(model, layer, head, source, seed=layer + head)
    reference, plain = copy.deepcopy(model), copy.deepcopy(model)
    heads = {layer: list(pairs) for layer, pairs in copies.items()}
    heads[2].append(3)  # GQA: each KV group loses one head
    heads[2].append(5)
    copies[2].update({3: 2, 5: 4})
    for head, source in ((3, 2), (5, 4)):
        make_redundant(model, 2, head, source, seed=head)
        make_redundant(reference, 2, head, source, seed=head)
        make_redundant(plain, 2, head, source, seed=head)
    sinv_prune.prune_heads(plain, heads)
    batches = calibration(length=16)
    summary = sinv_prune.prune_heads(
        model, heads, calibration=batches, compensate="lsq", ridge=1e-10, precision="float64"
    )
    inputs = model_inputs(seed=7, batch=3, length=20)  # longer than the window: sliding masks matter
    expected = model_output(reference, inputs)
    assert (model_output(plain, inputs) - expected).abs().max() > 1e-2
    torch.testing.assert_close(model_output(model, inputs), expected, atol=1e-4, rtol=0)
    assert all(f.refit and f.error_after < 1e-5 for f in summary.compensation.layers)


# -- held-out split --------------------------------------------------------------------------------


def test_heldout_sequences_are_spread_and_counted():
    model = tiny_model("llama")
    batches = calibration(batches=4, batch=4, pad=True)
    inputs = capture_block_inputs(model, get_adapter(model), batches, holdout=0.125)
    held_rows = [r for n, i in enumerate(inputs) for r in range(4) if i.positions[r].all()]
    assert len(held_rows) == 2  # 16 sequences, an eighth held out
    assert sum(int(i.heldout.sum()) for i in inputs) == sum(
        int(b["attention_mask"][r].sum()) for b, i in zip(batches, inputs, strict=True) for r in range(4)
        if i.positions[r].all()
    )  # fmt: skip
    mark_heldout(inputs[:1], 0.5)  # one batch of 4: 2 held out
    assert int(inputs[0].positions.all(1).sum()) == 2
    single = capture_block_inputs(model, get_adapter(model), [model_inputs(batch=1, length=16)], holdout=0.25)
    assert single[0].positions[0].tolist() == [False] * 12 + [True] * 4


# -- the guard: compensation never ends worse than plain pruning on held-out tokens ------------------


def heldout_loss(model, batches) -> float:
    """Mean next-token cross-entropy over ``batches``."""
    total, count = 0.0, 0
    for b in batches:
        with torch.no_grad():
            logits = model(**b).logits[:, :-1]
        labels = b["input_ids"][:, 1:]
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"))
        count += labels.numel()
    return total / count


def test_guard_keeps_plain_pruning_where_the_refit_does_not_generalise():
    """Starved layers and few tokens: an unguarded refit overfits and ends worse than plain pruning."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # peaked predictions, so that hidden-state errors show in the loss
    plan = {"mlp": {0: list(range(2, 64)), 1: list(range(8, 64)), 2: list(range(36, 64))}}
    sequences = calibration(batches=8, batch=1, length=8)
    held_batches = [sequences[3], sequences[7]]  # what holdout=0.25 holds out of 8 sequences
    fit_batches = [b for i, b in enumerate(sequences) if i not in (3, 7)]
    plain, unguarded = copy.deepcopy(model), copy.deepcopy(model)
    sinv_prune.prune(plain, plan)
    sinv_prune.prune(unguarded, plan, calibration=fit_batches, compensate="lsq", ridge=1e-6, holdout=0)
    summary = sinv_prune.prune(model, plan, calibration=sequences, compensate="lsq", ridge=1e-6, holdout=0.25)
    report = summary.compensation
    plain_loss, unguarded_loss, guarded_loss = (heldout_loss(m, held_batches) for m in (plain, unguarded, model))
    assert unguarded_loss > plain_loss  # the blow-up: lsq alone makes the model worse
    assert guarded_loss <= plain_loss
    assert report.heldout_tokens == 2 * 8
    assert report.heldout_loss["plain"] == pytest.approx(plain_loss, rel=1e-5)
    assert report.heldout_loss["compensated"] >= report.heldout_loss["plain"] or report.kept == "compensated"
    assert "held-out cross-entropy" in str(report) and f"kept the {report.kept} model" in str(report)
    assert not all(f.refit for f in report.layers) or report.kept == "plain"


def test_guard_keeps_a_refit_that_generalises_and_picks_a_ridge():
    model = tiny_model("gpt2")
    plan = {"mlp": {0: list(range(0, 40, 2)), 1: list(range(1, 40, 3))}}
    summary = sinv_prune.prune(model, plan, calibration=calibration(8), compensate="lsq")
    report = summary.compensation
    assert report.ridge == "auto" and report.kept == "compensated"
    assert report.heldout_loss["compensated"] < report.heldout_loss["plain"]
    for f in report.layers:
        assert f.refit and f.ridge in RIDGES and f.heldout_after < f.heldout_before
    assert report.us_per_token > 0 and report.to_dict()["us_per_token"] == report.us_per_token


def test_plain_kept_restores_the_plainly_pruned_weights(monkeypatch):
    """When the held-out loss prefers plain pruning, every consumer holds its plainly pruned weights."""
    from sinv_prune.surgery import heldout

    model, plain = tiny_model("gpt2"), tiny_model("gpt2")
    plan = {"mlp": {0: list(range(0, 40, 2))}, "heads": {1: [0]}}
    sinv_prune.prune(plain, plan)
    calls = []

    def rigged(self):  # unpruned, compensated, plain: the plain model looks better
        calls.append(1)
        return {1: 0.0, 2: 2.0, 3: 1.0}[len(calls)]

    monkeypatch.setattr(heldout.HeldOutLoss, "__call__", rigged)
    summary = sinv_prune.prune(model, plan, calibration=calibration(8), compensate="lsq")
    assert summary.compensation.kept == "plain" and summary.compensation.heldout_loss["plain"] == 1.0
    theirs = plain.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())


# -- precision and the ridge default -----------------------------------------------------------------


def test_float32_products_match_float64_statistics():
    """Statistics from float32 products (summed in float64) against float64 products: fit and error agree."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(256, 256, generator=g) / 16
    weight, bias = torch.randn(64, 256, generator=g) / 16, torch.randn(64, generator=g)
    fits = {dt: ConsumerFit(256, 64, bias=True, device=torch.device("cpu"), product_dtype=dt)
            for dt in (torch.float32, torch.float64)}  # fmt: skip
    for _ in range(32):  # 32 batches of 512 tokens, correlated inputs
        x = torch.randn(512, 256, generator=g) @ mix + 0.5
        y = x @ torch.randn(256, 64, generator=g) / 16
        for fit in fits.values():
            fit.update(x, y)
    f32, f64 = fits[torch.float32], fits[torch.float64]
    assert ((f32.gram - f64.gram).norm() / f64.gram.norm()).item() < 1e-6
    w32, b32 = f32.solve(weight, bias, 0.01)
    w64, b64 = f64.solve(weight, bias, 0.01)
    assert ((w32 - w64).norm() / w64.norm()).item() < 1e-4
    assert abs(f32.relative_error(w64, b64) - f64.relative_error(w64, b64)) < 1e-4


def test_default_ridge_falls_with_the_token_count():
    assert default_ridge(8192) == pytest.approx(0.1)
    assert default_ridge(1024) == pytest.approx(1.0, rel=1e-6)
    assert default_ridge(32768) < 0.1 and default_ridge(16) == 10.0 and default_ridge(10**9) == 0.01


BAD = [
    (dict(precision="float16"), "precision must be one of"),
    (dict(holdout=0.9), "holdout must be a share"),
    (dict(ridge="auto"), "ridge must be"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_guard_arguments_raise(kwargs, message):
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=message):
        sinv_prune.prune(model, {"mlp": {0: [1]}}, calibration=calibration(1), compensate="lsq", **kwargs)


def test_recipe_compensate_schema_passes_obs_holdout_precision_and_target():
    from sinv_prune.pipeline.recipe import CompensateSpec

    spec = CompensateSpec(method="obs", holdout=0.25, precision="float64", target="residual")
    assert spec.prune_options() == {"compensate": "obs", "add_bias": False, "holdout": 0.25, "precision": "float64",
                                    "target": "residual"}  # fmt: skip
    assert CompensateSpec().batches == 64 and CompensateSpec().prune_options()["holdout"] == 0.125
    assert CompensateSpec().prune_options()["target"] == "output"
    assert get_args(CompensateSpec.model_fields["target"].annotation) == TARGETS
    with pytest.raises(ValueError, match="target"):
        CompensateSpec(target="stream")
    with pytest.raises(ValueError, match="holdout"):
        CompensateSpec(holdout=0.6)
    with pytest.raises(ValueError, match="method"):
        CompensateSpec(method="ols")
