"""OBS over whole KV groups (a plan emptying KV groups lets OBS choose which), and :func:`obs_order`."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import model_inputs, model_output, tiny_model
from test_compensation import calibration

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.surgery.obs import DAMP, damped, obs_order, obs_select
from sinv_prune.surgery.record import get_record

OPTIONS = dict(ridge=1e-10, precision="float64", holdout=0)
LAYER = 1


def gqa_model():
    """8 query heads in 4 KV groups of 2, hidden 64; layer 1's group 3 (heads 6, 7) copies group 1 (heads 2, 3)."""
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=64, head_dim=8)
    attn = get_adapter(model).attention(LAYER)
    d = 8
    copy_rows, source_rows = slice(6 * d, 8 * d), slice(2 * d, 4 * d)
    with torch.no_grad():
        attn.q_proj.weight[copy_rows] = attn.q_proj.weight[source_rows]
        attn.k_proj.weight[3 * d : 4 * d] = attn.k_proj.weight[d : 2 * d]
        attn.v_proj.weight[3 * d : 4 * d] = attn.v_proj.weight[d : 2 * d]
        attn.o_proj.weight[:, copy_rows] *= 5  # large, so that losing it shows
    return model


def error_of(summary, layer: int) -> float:
    return next(f.error_after for f in summary.compensation.layers if f.layer == layer and f.unit == "heads")


def test_obs_chooses_the_dependent_kv_group_and_the_refit_is_exact():
    model = gqa_model()
    reference, lsq = copy.deepcopy(model), copy.deepcopy(model)
    plan = {"heads": {LAYER: [4, 5]}}  # group 2: independent of the others, so the wrong one
    lsq_summary = sinv_prune.prune(lsq, plan, calibration=calibration(), compensate="lsq", **OPTIONS)
    summary = sinv_prune.prune(model, plan, calibration=calibration(), compensate="obs", **OPTIONS)

    (change,) = summary.layers
    assert change.removed in ([2, 3], [6, 7]) and change.kept == 6 and change.kept_kv == 3  # the copy or its source
    assert get_record(model.config).pruned_heads == {LAYER: change.removed}
    assert error_of(summary, LAYER) < 1e-6
    assert error_of(lsq_summary, LAYER) > 0.05
    inputs = model_inputs(seed=7, batch=3, length=20)
    expected = model_output(reference, inputs)
    torch.testing.assert_close(model_output(model, inputs), expected, atol=1e-4 * expected.abs().max(), rtol=0)
    assert (model_output(lsq, inputs) - expected).abs().max() > 1e-2 * expected.abs().max()


def test_obs_groups_report_original_numbering_and_reload(tmp_path):
    model = gqa_model()
    sinv_prune.prune_heads(model, {LAYER: [0, 1]})  # group 0 goes first: now heads 0..5 are original 2..7
    reference = copy.deepcopy(model)
    summary = sinv_prune.prune_heads(model, {LAYER: [2, 3]}, calibration=calibration(), compensate="obs", **OPTIONS)

    (change,) = summary.layers
    assert (change.removed, change.removed_original) in (([0, 1], [2, 3]), ([4, 5], [6, 7]))
    assert change.kept_kv == 2
    assert get_record(model.config).pruned_heads == {LAYER: [0, 1, *change.removed_original]}
    inputs = model_inputs(seed=7, batch=3, length=20)
    expected = model_output(reference, inputs)
    torch.testing.assert_close(model_output(model, inputs), expected, atol=1e-4 * expected.abs().max(), rtol=0)
    model.save_pretrained(tmp_path)
    again = sinv_prune.from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(model_output(again, inputs), model_output(model, inputs))


def test_mixed_plan_keeps_the_per_group_quotas():
    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=3)  # 3 KV groups of 2
    plan = {0: [0, 1, 2, 4], 2: [0, 1]}  # layer 0: group 0 emptied, one of each other; 2: whole
    summary = sinv_prune.prune_heads(model, plan, calibration=calibration(), compensate="obs")
    changes = {c.layer: c for c in summary.layers}
    assert changes[0].removed[:2] == [0, 1] and sorted(h // 2 for h in changes[0].removed[2:]) == [1, 2]
    assert changes[0].kept_kv == 2 and changes[0].kept == 2
    assert len(changes[2].removed) == 2 and changes[2].removed[0] % 2 == 0  # some whole group, OBS's choice
    assert changes[2].removed[1] == changes[2].removed[0] + 1 and changes[2].kept_kv == 2
    assert model_output(model, model_inputs()).isfinite().all()


def refit_error(h: torch.Tensor, weight: torch.Tensor, kept: torch.Tensor) -> float:
    """``min_V (W - V) H (W - V)^T`` with ``V`` on the ``kept`` columns only (the Schur complement of H_kk)."""
    w = weight.double()
    h_k = h[:, kept]
    return float(torch.trace(w @ h @ w.T) - torch.trace(w @ h_k @ torch.linalg.solve(h[kept][:, kept], h_k.T @ w.T)))


@pytest.mark.parametrize("width", [1, 3])
def test_obs_order_costs_are_the_refit_errors(width):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 24, generator=g, dtype=torch.float64) @ torch.randn(24, 24, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 24, generator=g, dtype=torch.float64)
    gram = x.T @ x
    units, costs = obs_order(gram, weight, width, None, 24 // width - 1)
    assert len(set(units)) == len(units) == len(costs) == 24 // width - 1
    h = damped(gram)
    assert torch.isclose(h.diagonal() - gram.diagonal(), DAMP * gram.diagonal().mean()).all()
    for k in range(len(units)):
        gone = set(units[: k + 1])
        kept = torch.tensor([c for c in range(24) if c // width not in gone])
        expected = refit_error(h, weight, kept)
        assert costs[k] == pytest.approx(expected, rel=1e-9, abs=1e-9 * costs[-1])
    assert all(b >= a for a, b in zip(costs, costs[1:], strict=False))


def test_obs_order_obeys_quotas_and_agrees_with_obs_select():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(100, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(3, 8, generator=g, dtype=torch.float64)
    quotas = [([0, 1, 2, 3], 1), ([4, 5, 6], 2)]  # unit 7 is in no group: it never goes
    units, costs = obs_order(x.T @ x, weight, 1, quotas, 3)
    assert sum(u < 4 for u in units) == 1 and sum(4 <= u < 7 for u in units) == 2
    assert sorted(units) == obs_select(x.T @ x, weight, 1, quotas)
    assert obs_order(x.T @ x, weight, 1, quotas, 1)[0] == units[:1]  # a prefix: the greedy order itself
    with pytest.raises(ValueError, match="quotas allow 3"):
        obs_order(x.T @ x, weight, 1, quotas, 4)
