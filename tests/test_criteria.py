"""Criteria: registry, shapes on every architecture, determinism, and each criterion against a direct computation."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import ARCHS, model_inputs, tiny_model

from sinv_prune import get_adapter, head_gates, head_measures, prune_heads
from sinv_prune.scoring.criteria import (
    ActivationCriterion,
    Criterion,
    MagnitudeCriterion,
    SinvEarlyCriterion,
    TaylorCriterion,
    available_criteria,
    get_criterion,
    register_criterion,
)
from sinv_prune.scoring.criteria.registry import _CRITERIA as REGISTRY
from sinv_prune.scoring.trace import append_trace

BUILTIN = ["activation", "entropy", "magnitude", "random", "sinv_early", "sinv_gauge", "sinv_static", "taylor"]
# A prior pruning per architecture: GQA-valid, and one layer emptied.
PRIOR = {
    "gpt2": {0: [1], 1: [0, 1, 2, 3]},
    "bert": {0: [1], 1: [0, 1, 2, 3]},
    "roberta": {0: [1], 1: [0, 1, 2, 3]},
    "llama": {0: [0, 3], 1: list(range(6)), 2: [3, 4, 5]},
    "qwen2": {0: [0, 2, 4], 1: list(range(6))},
    "mistral": {0: [0, 2], 1: list(range(4))},
}


def batches_for(arch: str, n: int = 1) -> list[dict]:
    out = [model_inputs(seed) for seed in range(n)]
    if arch == "roberta":  # sequence classification: labels are needed for a loss
        out = [{**b, "labels": torch.tensor([0, 1])} for b in out]
    return out


def flat(scores) -> list[float]:
    return [x for layer in scores for x in layer]


def shape(scores) -> list[int]:
    return [len(layer) for layer in scores]


def c_q_trace(model, epochs=(0.0, 1.0)) -> list[dict]:
    cq = head_measures(model, keys=["C_Q"])["C_Q"]
    return [{"step": i, "epoch": e, "C_Q": cq} for i, e in enumerate(epochs)]


_MODELS: dict = {}


def model_for(arch: str, pruned: bool):
    """Cached tiny model, optionally after a prior pruning, plus a trace in original numbering."""
    if (arch, pruned) not in _MODELS:
        model = tiny_model(arch)
        trace = c_q_trace(model)
        if pruned:
            prune_heads(model, PRIOR[arch], allow_empty_layers=True)
        _MODELS[arch, pruned] = (model, trace)
    return _MODELS[arch, pruned]


# -- registry -----------------------------------------------------------------------------


def test_registry_lists_builtins():
    assert set(BUILTIN) <= set(available_criteria())
    for name in BUILTIN:
        assert get_criterion(name).name == name


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="known criteria: .*magnitude.*taylor"):
        get_criterion("tayler")


def test_unknown_option_lists_options():
    with pytest.raises(ValueError, match="its options: p"):
        get_criterion("magnitude", q=3)


def test_register_custom_and_refuse_duplicates():
    try:

        @register_criterion("ones_for_test")
        class Ones(Criterion):
            def scores(self, model):
                return [[1.0] * n for n in shape(head_measures(model, keys=["C_Q"])["C_Q"])]

        assert "ones_for_test" in available_criteria()
        assert get_criterion("ones_for_test").scores(tiny_model("gpt2")) == [[1.0] * 4] * 3
        with pytest.raises(ValueError, match="already registered"):
            register_criterion("ones_for_test")(Ones)
    finally:
        REGISTRY.pop("ones_for_test", None)
    with pytest.raises(ValueError, match="lower snake case"):
        register_criterion("Bad Name")
    with pytest.raises(TypeError, match="Criterion subclass"):
        register_criterion("not_a_criterion")(object)


def test_missing_inputs_raise():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="needs data"):
        get_criterion("taylor").compute(model)
    with pytest.raises(ValueError, match="needs data"):
        get_criterion("entropy").compute(model, batches=[])
    with pytest.raises(ValueError, match="needs a trace"):
        get_criterion("sinv_early").compute(model)


# -- every criterion, every architecture --------------------------------------------------


@pytest.mark.parametrize("pruned", [False, True], ids=["fresh", "pruned"])
@pytest.mark.parametrize("name", BUILTIN)
def test_shape_matches_c_q(arch, name, pruned):
    model, trace = model_for(arch, pruned)
    expected = shape(head_measures(model, keys=["C_Q"])["C_Q"])
    scores = get_criterion(name).compute(model, batches_for(arch), trace)
    assert shape(scores) == expected
    assert all(isinstance(x, float) and math.isfinite(x) for layer in scores for x in layer)
    assert all(p.grad is None for p in model.parameters())
    again = get_criterion(name).compute(model, batches_for(arch), trace)
    assert again == scores, "criteria are deterministic"


def test_random_seeded():
    model = tiny_model("llama")
    a = get_criterion("random", seed=3).compute(model)
    assert a == get_criterion("random", seed=3).compute(model)
    assert a != get_criterion("random", seed=4).compute(model)
    assert all(0 <= x < 1 for layer in a for x in layer)


# -- magnitude ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("which", ["llama", "gpt2", "qwen2"])
def test_magnitude_matches_direct(which, p):
    model = tiny_model(which)
    adapter = get_adapter(model)
    scores = MagnitudeCriterion(p=p).compute(model)
    for layer in range(adapter.num_layers):
        lay, w = adapter.layout(layer), adapter.projections(layer)
        d = lay.head_dim
        for h in range(lay.num_heads):
            kv = h // lay.group_size
            parts = [w.q[h * d : (h + 1) * d], w.k[kv * d : (kv + 1) * d], w.v[kv * d : (kv + 1) * d],
                     w.o[:, h * d : (h + 1) * d]]  # fmt: skip
            direct = torch.cat([t.detach().reshape(-1) for t in parts]).norm(p=p)
            assert scores[layer][h] == pytest.approx(float(direct), rel=1e-5)


def test_magnitude_rejects_other_p():
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        MagnitudeCriterion(p=3)


# -- sinv_static --------------------------------------------------------------------------


def test_sinv_static_is_c_q_and_invert():
    model = tiny_model("qwen2")
    cq = head_measures(model)["C_Q"]
    assert get_criterion("sinv_static").compute(model) == cq
    inverted = get_criterion("sinv_static", invert=True).compute(model)
    assert flat(inverted) == pytest.approx([1 - x for x in flat(cq)])


# -- sinv_gauge ---------------------------------------------------------------------------


def test_sinv_gauge_is_c_qk_gauge_and_invert():
    model = tiny_model("llama")
    gauge = head_measures(model, keys=["C_QK_gauge"])["C_QK_gauge"]
    assert get_criterion("sinv_gauge").compute(model) == gauge
    inverted = get_criterion("sinv_gauge", invert=True).compute(model)
    assert flat(inverted) == pytest.approx([1 - x for x in flat(gauge)])
    with pytest.raises(ValueError, match="its options: invert"):
        get_criterion("sinv_gauge", measure="C_Q")


def test_sinv_gauge_sees_through_a_reparametrised_attractor_head():
    """A head at the attractor up to a gauge (W_Q = A W, W_K = -A^-T W) goes first under sinv_gauge, not sinv_static."""
    model = tiny_model("gpt2")
    w = get_adapter(model).projections(1)
    d, dim = 8, 32
    g = torch.Generator().manual_seed(0)
    base = torch.randn(d, dim, generator=g) * 0.05
    a = 3 * torch.eye(d)  # C_Q = ||3W - W/3|| / (3||W|| + ||W||/3) = 0.8, above every random head's
    with torch.no_grad():  # views of c_attn's weight: head 2 of layer 1
        w.q[2 * d : 3 * d] = a @ base
        w.k[2 * d : 3 * d] = -torch.linalg.inv(a).T @ base
    gauge = get_criterion("sinv_gauge").compute(model)
    assert gauge[1][2] == pytest.approx(0.0, abs=1e-5)
    assert prune_order(gauge)[0] == (1, 2)
    c_q = get_criterion("sinv_static").compute(model)
    assert prune_order(c_q)[0] != (1, 2)  # C_Q is not gauge invariant: this head looks far from the attractor
    assert c_q[1][2] == pytest.approx(0.8, rel=1e-4)


# -- activation ---------------------------------------------------------------------------


def head_outputs(model, which: str, batch: dict) -> list[torch.Tensor]:
    """Per layer ``[B, T, H, d]``: each head's output, rebuilt from attention weights and value projections."""
    adapter = get_adapter(model)
    with torch.no_grad():
        out = model(**batch, output_attentions=True, output_hidden_states=True)
    result = []
    for layer, attn in enumerate(out.attentions):
        lay, w = adapter.layout(layer), adapter.projections(layer)
        block = adapter.layers()[layer]
        normed = (block.ln_1 if which == "gpt2" else block.input_layernorm)(out.hidden_states[layer])
        v = normed @ w.v.T + (w.v_bias if w.v_bias is not None else 0)  # [B, T, KV*d]
        v = v.unflatten(-1, (lay.num_kv_heads, lay.head_dim)).transpose(1, 2)  # [B, KV, T, d]
        v = v.repeat_interleave(lay.group_size, dim=1)
        result.append((attn @ v).transpose(1, 2))  # [B, T, H, d]
    return result


@pytest.mark.parametrize("metric", ["fluctuation", "magnitude"])
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_activation_matches_direct(which, metric):
    model = tiny_model(which)
    batches = [
        {**model_inputs(0), "attention_mask": torch.tensor([[1] * 9, [1] * 5 + [0] * 4])},
        model_inputs(1, length=7),
    ]
    scores = ActivationCriterion(metric=metric).compute(model, batches)
    adapter = get_adapter(model)
    for layer in range(adapter.num_layers):
        tokens = []
        for batch in batches:
            x = head_outputs(model, which, batch)[layer]
            mask = batch.get("attention_mask", torch.ones(x.shape[:2], dtype=torch.long))
            tokens.append(x[mask.bool()].double())  # [n, H, d]
        x = torch.cat(tokens)
        assert x.shape[0] == 9 + 5 + 2 * 7
        w_o = adapter.projections(layer).o.detach().double().unflatten(1, x.shape[1:])  # [D, H, d]
        if metric == "fluctuation":
            direct = (x.var(dim=0, unbiased=False) * w_o.square().sum(0)).sum(-1)
        else:
            direct = x.norm(dim=-1).mean(0) * w_o.square().sum(dim=(0, 2)).sqrt()
        assert scores[layer] == pytest.approx(direct.tolist(), rel=1e-4)


@pytest.mark.parametrize("which", ["llama", "bert"])
def test_activation_ignores_padding(which):
    model = tiny_model(which)
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    batch = {**model_inputs(0), "attention_mask": mask}
    garbage = batch["input_ids"].clone()
    garbage[1, 6:] = torch.tensor([5, 6, 7])
    for metric in ("fluctuation", "magnitude"):
        padded = ActivationCriterion(metric=metric).compute(model, [batch])
        changed = ActivationCriterion(metric=metric).compute(model, [{**batch, "input_ids": garbage}])
        assert flat(changed) == pytest.approx(flat(padded), rel=1e-9)
        unpadded = [{"input_ids": batch["input_ids"][:1]}, {"input_ids": batch["input_ids"][1:, :6]}]
        assert flat(ActivationCriterion(metric=metric).compute(model, unpadded)) == pytest.approx(
            flat(padded), rel=1e-5
        )
        everything = ActivationCriterion(metric=metric).compute(model, [{"input_ids": garbage}])
        assert flat(everything) != pytest.approx(flat(changed), rel=1e-3)  # without a mask they count


@pytest.mark.parametrize("metric", ["fluctuation", "magnitude"])
def test_activation_rises_with_a_heads_output(metric):
    """Scaling a head's value projection by 10 multiplies its output, so its score, and only its score, rises."""
    model = tiny_model("gpt2")
    batches = [model_inputs(seed) for seed in range(2)]
    before = ActivationCriterion(metric=metric).compute(model, batches)
    w, d = get_adapter(model).projections(2), 8
    with torch.no_grad():
        w.v[d : 2 * d] *= 10
        w.v_bias[d : 2 * d] *= 10
    after = ActivationCriterion(metric=metric).compute(model, batches)
    factor = 100 if metric == "fluctuation" else 10
    assert after[2][1] == pytest.approx(factor * before[2][1], rel=1e-5)
    assert [after[2][h] for h in (0, 2, 3)] == pytest.approx([before[2][h] for h in (0, 2, 3)], rel=1e-5)
    assert after[:2] == before[:2]
    assert max(after[2]) == after[2][1]


def test_activation_errors():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="unknown metric 'variance'; choose one of fluctuation, magnitude"):
        get_criterion("activation", metric="variance")
    with pytest.raises(ValueError, match="does not match the tokens"):
        get_criterion("activation").compute(model, [{**model_inputs(), "attention_mask": torch.ones(2, 4)}])
    with pytest.raises(ValueError, match="every token seen was padding"):
        get_criterion("activation").compute(model, [{**model_inputs(), "attention_mask": torch.zeros(2, 9)}])
    criterion = get_criterion("activation")
    criterion.update(model, model_inputs())
    prune_heads(model, {0: [1]})
    with pytest.raises(ValueError, match="head counts changed"):
        criterion.scores(model)
    with pytest.raises(ValueError, match="head counts changed between batches"):
        criterion.update(model, model_inputs())
    assert len(criterion.compute(model, [model_inputs()])[0]) == 3  # compute() resets


# -- sinv_early ---------------------------------------------------------------------------


def _series(before: float, after: float, at: int) -> list[float]:
    """C_Q at epochs 0..20: ``before`` until epoch ``at``, ``after`` from then on."""
    return [before] * at + [after] * (21 - at)


def constructed_trace() -> list[dict]:
    """Designed C_Q histories for the 12 heads of tiny gpt2 (3 layers x 4), epochs 0..20."""
    heads = {
        (0, 0): _series(0.7, 0.02, 3),  # crosses at epoch 3, min 0.02
        (0, 1): _series(0.7, 0.01, 3),  # crosses at epoch 3, min 0.01 -> before (0, 0)
        (0, 2): _series(0.7, 0.001, 5),  # crosses later, though lower
        (1, 0): _series(0.3, 0.01, 16),  # crosses only at epoch 16: outside the window, min 0.3 inside
        (1, 1): _series(0.7, 0.2, 2),  # never below 0.05, min 0.2
        (2, 3): [0.04] + [0.3] * 20,  # crosses at epoch 0, then rises again
    }
    records = []
    for epoch in range(21):
        default = [[[0.7 - 0.01 * (4 * layer + h)] * 21 for h in range(4)] for layer in range(3)]
        cq = [[heads.get((layer, h), default[layer][h])[epoch] for h in range(4)] for layer in range(3)]
        records.append({"step": 10 * epoch, "epoch": float(epoch), "C_Q": cq})
    return records


def prune_order(scores) -> list[tuple[int, int]]:
    flat = [(s, (layer, h)) for layer, row in enumerate(scores) for h, s in enumerate(row)]
    return [head for _, head in sorted(flat)]


def test_sinv_early_order_and_report(tmp_path):
    model = tiny_model("gpt2")
    trace = constructed_trace()
    criterion = SinvEarlyCriterion(trace=trace)
    scores = criterion.compute(model)
    order = prune_order(scores)
    assert order[:4] == [(2, 3), (0, 1), (0, 0), (0, 2)]  # by crossing epoch, then lowest C_Q
    assert order[4:6] == [(1, 1), (1, 0)]  # then lowest C_Q in the first 15 epochs: 0.2 < 0.7-0.04
    assert criterion.crossed == 4
    report = criterion.report()
    assert report["crossed"] == 4
    assert report["crossed_heads"] == {0: [0, 1, 2], 2: [3]}
    assert report["crossing"][0][2] == {"step": 50, "epoch": 5.0}
    assert report["crossing"][1][0] is None
    assert report["min_in_window"][1][0] == pytest.approx(0.3)
    json.dumps(report)
    # Crossing heads score below zero, the others their minimum C_Q.
    assert all(scores[layer][h] < 0 for layer, h in order[:4])
    assert scores[1][1] == pytest.approx(0.2)

    # The whole trace: (1, 0) crosses too, last.
    whole = SinvEarlyCriterion(trace=trace, epochs=None)
    assert prune_order(whole.compute(model))[:5] == [(2, 3), (0, 1), (0, 0), (0, 2), (1, 0)]
    assert whole.crossed == 5

    # A trace file works like its records; invert reverses the order.
    path = tmp_path / "trace.jsonl"
    for record in trace:
        append_trace(path, record)
    assert SinvEarlyCriterion(trace=path).compute(model) == scores
    assert prune_order(SinvEarlyCriterion(trace=str(path), invert=True).compute(model)) == prune_order(scores)[::-1]


def test_sinv_early_none_cross_orders_by_lowest_c_q():
    model = tiny_model("gpt2")
    trace = c_q_trace(model, epochs=(0.0, 1.0, 2.0))
    criterion = get_criterion("sinv_early")
    scores = criterion.compute(model, trace=trace)
    assert criterion.report()["crossed"] == 0
    assert scores == trace[0]["C_Q"]


def test_sinv_early_maps_original_numbering_after_pruning():
    model = tiny_model("llama")
    trace = [{"step": 0, "epoch": 0.0, "C_Q": [[0.1 * h + layer for h in range(6)] for layer in range(3)]}]
    prune_heads(model, {0: [0, 3], 2: [1, 2, 4, 5]})
    scores = SinvEarlyCriterion(trace=trace).compute(model)
    assert scores[0] == pytest.approx([0.1, 0.2, 0.4, 0.5])
    assert scores[2] == pytest.approx([2.0, 2.3])
    assert len(trace[0]["C_Q"][0]) == 6  # the trace itself is not modified


def test_sinv_early_errors():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="without an epoch"):
        SinvEarlyCriterion(trace=[{"step": 0, "epoch": None, "C_Q": [[0.5] * 4] * 3}]).compute(model)
    with pytest.raises(ValueError, match="within the first 15 epochs"):
        SinvEarlyCriterion(trace=[{"step": 0, "epoch": 20.0, "C_Q": [[0.5] * 4] * 3}]).compute(model)
    with pytest.raises(ValueError, match="head counts"):
        SinvEarlyCriterion(trace=[{"step": 0, "epoch": 0.0, "C_Q": [[0.5] * 5] * 3}]).compute(model)
    with pytest.raises(ValueError, match="threshold must be positive"):
        SinvEarlyCriterion(threshold=0)


# -- taylor -------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["llama", "bert"])
def test_taylor_matches_gate_gradients(which):
    model = tiny_model(which)
    model.train()
    model.get_input_embeddings().eval()  # a mixed-mode model, to check modes come back
    modes = [m.training for m in model.modules()]
    batches = batches_for(which, 2)
    criterion = TaylorCriterion(normalize=False)
    raw = criterion.compute(model, batches)
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())
    assert all(x > 0 and math.isfinite(x) for layer in raw for x in layer)

    reference = copy.deepcopy(model).eval()
    expected = None
    for batch in batches:
        with head_gates(reference) as gates:
            reference(**batch, labels=batch["input_ids"]).loss.backward()
            grads = [g.grad.abs() for g in gates]
        expected = grads if expected is None else [a + b for a, b in zip(expected, grads, strict=True)]
    assert shape(raw) == shape(expected)
    assert flat(raw) == pytest.approx(flat(g.tolist() for g in expected), rel=1e-4)

    normalized = TaylorCriterion().compute(model, batches)
    for layer in normalized:
        assert math.sqrt(sum(x * x for x in layer)) == pytest.approx(1.0)


def test_taylor_needs_labels_without_lm_head():
    model = tiny_model("roberta")
    with pytest.raises(ValueError, match="no labels"):
        TaylorCriterion().compute(model, [model_inputs()])
    scores = TaylorCriterion(loss_fn=lambda m, b: m(**b).logits.sum()).compute(model, [model_inputs()])
    assert shape(scores) == [4, 4, 4]


# -- entropy ------------------------------------------------------------------------------


def test_entropy_matches_direct_and_restores_attention():
    model = tiny_model("llama", attn_implementation="sdpa")
    with torch.no_grad():  # sharper, head-specific attention than the tiny init gives
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(torch.linspace(1, 40, 48)[:, None])
    batch = {**model_inputs(), "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3])}
    scores = get_criterion("entropy").compute(model, [batch])
    assert model.config._attn_implementation == "sdpa"

    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(**batch, output_attentions=True).attentions
    mask = batch["attention_mask"].double()
    for layer, att in enumerate(attentions):
        p = att.double()
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [B, H, T]
        direct = -(ent * mask[:, None]).sum(dim=(0, 2)) / mask.sum()
        assert scores[layer] == pytest.approx(direct.tolist(), rel=1e-6)
    assert len({round(x, 6) for x in scores[0]}) > 1
    inverted = get_criterion("entropy", invert=True).compute(model, [batch])
    assert flat(inverted) == pytest.approx([-x for x in flat(scores)])


@pytest.mark.parametrize("name", BUILTIN)
def test_reports_are_json_and_say_what_was_scored(name):
    # the report read back from JSON: the counts of what was scored (two batches of 2 x 9 tokens) and, for
    # sinv_early, per head the window's lowest C_Q (no head crosses 0.05 here), which is then its score
    model = tiny_model("gpt2")
    criterion = get_criterion(name)
    batches, trace = batches_for("gpt2", 2), c_q_trace(model)
    scores = criterion.compute(model, batches, trace)
    tokens = sum(b["input_ids"].numel() for b in batches)
    lowest = [[min(r["C_Q"][layer][h] for r in trace) for h in range(len(row))] for layer, row in enumerate(scores)]
    expected = {
        "activation": {"metric": "fluctuation", "batches": 2, "tokens": tokens},
        "entropy": {"batches": 2, "query_rows": tokens, "invert": False},
        "taylor": {"batches": 2, "normalize": True},
        "sinv_early": {"crossed": 0, "crossed_heads": {}, "threshold": 0.05, "epochs": 15, "measure": "C_Q",
                       "window_records": 2, "window": [{"step": r["step"], "epoch": r["epoch"]} for r in trace],
                       "crossing": [[None] * len(row) for row in scores], "min_in_window": lowest},
    }.get(name, {})  # fmt: skip
    assert json.loads(json.dumps(criterion.report())) == expected
    if name == "sinv_early":
        assert scores == lowest


def test_all_archs_listed():
    assert set(PRIOR) == set(ARCHS)
