"""Criteria for mixture-of-experts experts: weights, routing statistics, the S-invariant ones, the trace."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from conftest import VOCAB, tiny_model

import sinv_prune
from sinv_prune import Part, Pruner, get_adapter
from sinv_prune.pipeline.tracking import ConvergenceCallback, track
from sinv_prune.scoring.criteria import criterion_class, get_criterion
from sinv_prune.scoring.measures import c_square, expert_measures, head_measures
from sinv_prune.scoring.trace import measurements, read_trace
from sinv_prune.surgery.record import get_record

EXPERT_CRITERIA = ("random", "magnitude", "frequency", "reap", "ean", "sinv_static", "sinv_early")
DATA_FREE = ("random", "magnitude", "sinv_static")
ROUTING = ("frequency", "reap", "ean")


def moe_model(kind: str = "qwen3_moe", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny random MoE model in eval mode: Qwen3-MoE with a dense layer 1, Qwen2-MoE (a shared expert,
    dense layer 1), Mixtral or OLMoE (every layer MoE)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip
    if kind == "qwen3_moe":
        cls, sizes = transformers.Qwen3MoeForCausalLM, dict(head_dim=8, moe_intermediate_size=16, num_experts=6)
        config = cls.config_class(**common, **sizes, intermediate_size=24, mlp_only_layers=[1], **overrides)
    elif kind == "qwen2_moe":
        cls, sizes = transformers.Qwen2MoeForCausalLM, dict(moe_intermediate_size=16, num_experts=6)
        config = cls.config_class(
            **common, **sizes, intermediate_size=24, shared_expert_intermediate_size=8, mlp_only_layers=[1], **overrides
        )
    elif kind == "mixtral":
        cls = transformers.MixtralForCausalLM
        config = cls.config_class(**common, head_dim=8, intermediate_size=16, num_local_experts=5, **overrides)
    else:
        cls = transformers.OlmoeForCausalLM
        config = cls.config_class(**common, intermediate_size=16, num_experts=5, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that outputs and norms are not tiny
        for layer in range(config.num_hidden_layers):
            block = get_adapter(model).moe_block(layer)
            if block is not None:
                for p in (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight):
                    p.normal_(0, 0.3)
    return model


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def batch(seed: int = 0, rows: int = 4, length: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (rows, length), generator=g)}


def moe_inputs(model, inputs: dict) -> dict[int, torch.Tensor]:
    """Per MoE layer, the tokens its sparse block receives, ``[tokens, hidden]``."""
    adapter, seen = get_adapter(model), {}
    hooks = [
        adapter.moe_block(layer).register_forward_pre_hook(
            lambda m, args, layer=layer: seen.__setitem__(layer, args[0].reshape(-1, args[0].shape[-1]))
        )
        for layer in range(adapter.num_layers)
        if adapter.num_experts(layer)
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def direct_routing(model, inputs: dict, renormalize: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """Per MoE layer and expert, from the router weight and ``expert_mlp`` directly (float64):
    routed-token count, sum of output norms, sum of gate value x output norm (the softmax probability,
    or with ``renormalize`` the probability over the sum of the token's top k)."""
    adapter = get_adapter(model)
    out = {}
    for layer, x in moe_inputs(model, inputs).items():
        x = x.double()
        probs = torch.softmax(x @ adapter.router(layer).weight.double().T, dim=-1)
        top, index = torch.topk(probs, adapter.top_k(), dim=-1)
        if renormalize:
            top = top / top.sum(-1, keepdim=True)
        count = adapter.num_experts(layer)
        stats = {k: torch.zeros(count, dtype=torch.float64) for k in ("routed", "norm", "gated")}
        for t in range(x.shape[0]):
            for slot in range(index.shape[1]):
                e = int(index[t, slot])
                w_gate, w_up, w_down = (w.double() for w in adapter.expert_mlp(layer, e))
                norm = (w_down @ (torch.nn.functional.silu(w_gate @ x[t]) * (w_up @ x[t]))).norm()
                stats["routed"][e] += 1
                stats["norm"][e] += norm
                stats["gated"][e] += top[t, slot] * norm
        out[layer] = stats
    return out


# -- which criteria score experts -----------------------------------------------------------------


def test_units_and_dense_layers():
    for name in EXPERT_CRITERIA:
        assert "experts" in criterion_class(name).units, name
    for name in ROUTING:
        assert criterion_class(name).units == ("experts",)
    assert criterion_class("sinv_gauge").units == ("heads",)
    model = moe_model()
    for name in [*DATA_FREE, *ROUTING]:
        scores = get_criterion(name, unit="experts").compute(model, [batch()])
        assert [len(row) for row in scores] == [6, 0, 6], name
        assert all(math.isfinite(x) for row in scores for x in row), name
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        get_criterion("reap", unit="experts").compute(tiny_model("llama"), [batch()])
    assert get_criterion("magnitude", unit="experts").compute(tiny_model("llama")) == [[], [], []]
    with pytest.raises(ValueError, match=r"unit 'experts' is scored by C_FF_experts, not 'C_Q'"):
        get_criterion("sinv_static", unit="experts", measure="C_Q").compute(model)


# -- routing statistics ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_frequency_counts_the_routers_top_k(kind):
    model = moe_model(kind)
    batches = [batch(0), batch(1, rows=2, length=7)]
    criterion = get_criterion("frequency", unit="experts")
    scores = criterion.compute(model, batches)
    adapter, k = get_adapter(model), model.config.num_experts_per_tok
    moe_layers = [layer for layer in range(adapter.num_layers) if adapter.num_experts(layer)]
    hand = {layer: torch.zeros(adapter.num_experts(layer), dtype=torch.long) for layer in moe_layers}
    tokens = 0
    for b in batches:
        with torch.no_grad():
            logits = model(**b, output_router_logits=True).router_logits
        assert len(logits) == len(moe_layers)
        for layer, layer_logits in zip(moe_layers, logits, strict=True):
            hand[layer] += torch.bincount(layer_logits.topk(k, dim=-1).indices.flatten(), minlength=len(hand[layer]))
        tokens += b["input_ids"].numel()
    report = criterion.report()
    assert report["tokens"] == tokens and report["batches"] == 2
    for layer in moe_layers:
        assert report["routed_tokens"][layer] == hand[layer].tolist()
        assert scores[layer] == pytest.approx((hand[layer].double() / tokens).tolist())
    assert sum(sum(row) for row in report["routed_tokens"]) == k * tokens * len(moe_layers)


@pytest.mark.parametrize(
    "kind,norm,renormalize",
    [("qwen3_moe", False, False), ("qwen3_moe", True, True), ("qwen2_moe", None, False), ("mixtral", None, True),
     ("olmoe", None, False)],
)  # fmt: skip
def test_reap_and_ean_equal_a_direct_computation(kind, norm, renormalize):
    model = moe_model(kind, **({} if norm is None else {"norm_topk_prob": norm}))
    inputs = batch(2, rows=2, length=6)
    reap = get_criterion("reap", unit="experts", renormalize=renormalize).compute(model, [inputs])
    ean = get_criterion("ean", unit="experts").compute(model, [inputs])
    for layer, stats in direct_routing(model, inputs, renormalize).items():
        mean = torch.where(stats["routed"] > 0, stats["gated"] / stats["routed"].clamp_min(1), 0.0)
        assert reap[layer] == pytest.approx(mean.tolist(), rel=1e-4, abs=1e-7)
        assert ean[layer] == pytest.approx(stats["norm"].tolist(), rel=1e-4, abs=1e-7)


def _reap_by_hand(stats: dict[str, torch.Tensor]) -> list[float]:
    return torch.where(stats["routed"] > 0, stats["gated"] / stats["routed"].clamp_min(1), 0.0).tolist()


def _ranking(row) -> list[int]:
    return sorted(range(len(row)), key=lambda e: row[e])


def test_reap_renormalises_by_default_where_the_config_sets_norm_topk_prob():
    """As the authors' code (CerebrasResearch/reap, "Renorm router logits by default"): the gate is the top-k
    renormalised weight on a ``norm_topk_prob`` model, the plain softmax probability otherwise."""
    inputs = batch(1, rows=4, length=12)
    for norm in (True, False):
        model = moe_model("qwen3_moe", seed=1, norm_topk_prob=norm)
        criterion = get_criterion("reap", unit="experts")
        scores = criterion.compute(model, [inputs])
        hand = {
            k: {layer: _reap_by_hand(s) for layer, s in direct_routing(model, inputs, k).items()} for k in (True, False)
        }
        # the two gates order this model's experts differently, so the ranking tells them apart
        assert any(_ranking(hand[True][layer]) != _ranking(hand[False][layer]) for layer in hand[True])
        for layer, row in hand[norm].items():
            assert _ranking(scores[layer]) == _ranking(row)
            assert scores[layer] == pytest.approx(row, rel=1e-4, abs=1e-7)
        assert criterion.report()["gate"] == (
            "softmax probability / its sum over the top k" if norm else "softmax probability"
        )
    with pytest.raises(ValueError, match="renormalize must be true, false or null"):
        get_criterion("reap", unit="experts", renormalize="yes")


def test_a_zeroed_expert_scores_lowest():
    model = moe_model()
    adapter = get_adapter(model)
    with torch.no_grad():
        for w in adapter.expert_mlp(2, 4):
            w.zero_()
    inputs = [batch(0, rows=4, length=16)]
    for name in ("magnitude", "reap", "ean", "sinv_static"):
        criterion = get_criterion(name, unit="experts")
        row = criterion.compute(model, inputs)[2]
        assert row[4] == 0.0, name
        assert all(x > 0 for e, x in enumerate(row) if e != 4), (name, row)
    assert get_criterion("frequency", unit="experts").compute(model, inputs)[2][4] > 0  # still routed


def test_never_routed_experts_score_zero():
    model = moe_model()
    with torch.no_grad():  # layer 0's experts see only (+-) hidden dimension 0: the router picks {0, 2} or {3, 4}
        norm = model.model.layers[0].post_attention_layernorm.weight
        norm.zero_()
        norm[0] = 1.0
        router = get_adapter(model).router(0).weight
        router.zero_()
        router[:, 0] = torch.tensor([3.0, 0.0, 2.0, -3.0, -2.0, 0.0])
    inputs = [batch(0)]
    for name in ROUTING:
        criterion = get_criterion(name, unit="experts")
        row = criterion.compute(model, inputs)[0]
        assert criterion.report()["never_routed"] == {0: [1, 5]}, name
        assert row[1] == row[5] == 0.0 and all(row[e] > 0 for e in (0, 2, 3, 4)), (name, row)


def test_padding_tokens_are_ignored():
    model = moe_model()
    full = batch(3, rows=2, length=10)
    mask = torch.ones_like(full["input_ids"])
    mask[1, 6:] = 0  # right padding: the real tokens see what they would see alone
    padded = {"input_ids": full["input_ids"], "attention_mask": mask}
    freq = get_criterion("frequency", unit="experts")
    freq.compute(model, [padded])
    assert freq.report()["tokens"] == int(mask.sum())
    with torch.no_grad():
        logits = model(**padded, output_router_logits=True).router_logits
    keep = mask.reshape(-1).bool()
    for layer, layer_logits in zip((0, 2), logits, strict=True):
        hand = torch.bincount(layer_logits[keep].topk(2, dim=-1).indices.flatten(), minlength=6)
        assert freq.report()["routed_tokens"][layer] == hand.tolist()
    alone = [{"input_ids": full["input_ids"][:1]}, {"input_ids": full["input_ids"][1:, :6]}]
    for name in ("ean", "frequency"):
        with_padding = get_criterion(name, unit="experts").compute(model, [padded])
        separately = get_criterion(name, unit="experts").compute(model, alone)
        for layer in (0, 2):
            assert with_padding[layer] == pytest.approx(separately[layer], rel=1e-4, abs=1e-7), name
    with pytest.raises(ValueError, match="every token seen was padding"):
        get_criterion("reap", unit="experts").compute(model, [{**padded, "attention_mask": torch.zeros_like(mask)}])


def test_routing_scores_refuse_a_pruned_model():
    model = moe_model()
    criterion = get_criterion("ean", unit="experts")
    criterion.update(model, batch())
    sinv_prune.prune(model, {"experts": {0: [1]}})
    with pytest.raises(ValueError, match="expert counts changed"):
        criterion.scores(model)


# -- S-invariant criteria -------------------------------------------------------------------------


def test_sinv_static_is_c_ff_of_each_experts_down_up():
    model = moe_model()
    adapter = get_adapter(model)
    scores = get_criterion("sinv_static", unit="experts").compute(model)
    inverted = get_criterion("sinv_static", unit="experts", invert=True).compute(model)
    assert scores == expert_measures(model) == head_measures(model)["C_FF_experts"]
    for layer in (0, 2):
        for e in range(6):
            _, w_up, w_down = adapter.expert_mlp(layer, e)
            direct = float(c_square(w_down.detach().double() @ w_up.detach().double()))
            assert scores[layer][e] == pytest.approx(direct, abs=1e-6)
            assert inverted[layer][e] == pytest.approx(1 - scores[layer][e])


def _trace(values_by_epoch: list[list[list[float]]]) -> list[dict]:
    return [{"step": 10 * i, "epoch": float(i), "C_FF_experts": v} for i, v in enumerate(values_by_epoch, 1)]


def test_sinv_early_orders_experts_by_their_crossing():
    model = moe_model()
    rows = [
        [[0.5, 0.4, 0.3, 0.2, 0.6, 0.7], [], [0.5] * 6],
        [[0.5, 0.04, 0.3, 0.01, 0.6, 0.7], [], [0.5, 0.5, 0.5, 0.5, 0.5, 0.2]],
        [[0.5, 0.02, 0.03, 0.01, 0.1, 0.7], [], [0.5] * 6],
        [[0.0] * 6, [], [0.0] * 6],  # after the window
    ]
    criterion = get_criterion("sinv_early", unit="experts", trace=_trace(rows), epochs=3)
    scores = criterion.scores(model)
    assert [len(r) for r in scores] == [6, 0, 6]
    # crossed at record 1 (min 0.01), record 1 (min 0.02), record 2 (min 0.03); then minima 0.1, 0.5, 0.7
    assert sorted(range(6), key=lambda e: scores[0][e]) == [3, 1, 2, 4, 0, 5]
    assert scores[0][3] == pytest.approx((1 + 0.01 / 0.05) / 3 - 1)
    assert scores[0][4] == pytest.approx(0.1) and scores[2] == pytest.approx([0.5] * 5 + [0.2])
    report = criterion.report()
    assert report["crossed"] == 3 and report["crossed_experts"] == {0: [1, 2, 3]}
    assert report["measure"] == "C_FF_experts"
    heads = get_criterion("sinv_early", trace=_trace(rows), epochs=3)
    with pytest.raises(ValueError, match="no C_Q measurement"):
        heads.scores(model)

    # the same trace scores the pruned model through its pruning record
    sinv_prune.prune(model, {"experts": {0: [0, 3], 2: [5]}})
    pruned = get_criterion("sinv_early", unit="experts", trace=_trace(rows), epochs=3).scores(model)
    assert pruned == [[scores[0][e] for e in (1, 2, 4, 5)], [], scores[2][:5]]


def test_tracking_records_expert_c_ff(tmp_path):
    model = moe_model().train()
    ids = torch.randint(3, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=2, learning_rate=1e-2,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, logging_steps=1,
    )  # fmt: skip
    callback = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=1)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    records = measurements(read_trace(tmp_path / "trace.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all([len(row) for row in r["C_FF_experts"]] == [6, 0, 6] for r in records)
    assert flat(records[-1]["C_FF_experts"]) == pytest.approx(flat(expert_measures(model)), abs=1e-6)
    assert records[0]["C_FF_experts"] != records[-1]["C_FF_experts"]  # measured as training moved the weights
    assert records[-1]["meta"]["num_experts"] == [6, 0, 6]
    scores = get_criterion("sinv_early", unit="experts", trace=tmp_path / "trace.jsonl", epochs=None).scores(model)
    assert scores[0] == pytest.approx([min(r["C_FF_experts"][0][e] for r in records) for e in range(6)])


def test_dense_trace_format_is_unchanged(tmp_path):
    record = track(tiny_model("llama"), tmp_path / "t.jsonl", 1)
    assert "C_FF_experts" not in record and "num_experts" not in record["meta"]
    assert "C_FF_experts" not in record["meta"]["forms"]
    assert head_measures(tiny_model("llama"), keys=["C_FF_experts"])["C_FF_experts"] == [[], [], []]


def test_a_measure_of_the_wrong_shape_is_refused():
    model = moe_model()
    with pytest.raises(ValueError, match=r"unit 'heads' is scored by a per-head measure .*, not 'C_FF_experts'"):
        get_criterion("sinv_static", measure="C_FF_experts").compute(model)
    with pytest.raises(ValueError, match=r"not 'C_FF'"):
        get_criterion("sinv_static", measure="C_FF").compute(model)
    assert get_criterion("sinv_static", measure="C_V").compute(model) == head_measures(model)["C_V"]


# -- pruning with them ----------------------------------------------------------------------------


def _masked_router_logits(model, plan: dict[int, list[int]], inputs: dict) -> torch.Tensor:
    """The unpruned model's logits with the routers giving the removed experts ``-inf``."""
    adapter = get_adapter(model)
    routers = {id(adapter.router(layer).weight): experts for layer, experts in plan.items()}
    linear = torch.nn.functional.linear

    def masked(x, weight, bias=None):
        out = linear(x, weight, bias)
        if id(weight) in routers:
            out = out.clone()
            out[..., routers[id(weight)]] = -math.inf
        return out

    torch.nn.functional.linear = masked
    try:
        with torch.no_grad():
            return model(**inputs).logits
    finally:
        torch.nn.functional.linear = linear


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_pruning_by_reap_matches_the_masked_router(kind):
    model = moe_model(kind)
    original = copy.deepcopy(model)
    calibration = [batch(0), batch(1)]
    expected = get_criterion("reap", unit="experts").compute(model, calibration)
    pruner = Pruner([Part("experts", "reap", 0.25)])
    pruner.prune(model, batches=calibration)
    removed = pruner.last_selection["experts"]
    assert removed and get_record(model.config).pruned_experts == removed
    for layer, experts in removed.items():  # uniform: the lowest REAP scores of every MoE layer go
        assert sorted(experts) == sorted(
            sorted(range(len(expected[layer])), key=expected[layer].__getitem__)[: len(experts)]
        )
    inputs = batch(5, rows=2, length=8)
    with torch.no_grad():
        pruned = model(**inputs).logits
    reference = _masked_router_logits(original, removed, inputs)
    assert torch.allclose(pruned, reference, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(original(**inputs).logits, reference, atol=1e-4)
