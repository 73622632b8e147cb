"""Experts of mixture-of-experts models: exact removal, the reload routes, refusals, the other units on MoE models.

Exact means: the pruned model computes what the original computes when its routers give the removed
experts' logits -inf (patched into ``torch.nn.functional.linear`` for the router weights only).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import tempfile

import pytest
import torch
import transformers
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.cli import main
from sinv_prune.scoring.criteria import get_criterion
from sinv_prune.surgery.record import get_record
from sinv_prune.units import get_unit

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
EXPERTS, TOP_K, LAYERS = 6, 2, 3
HYPOTHESIS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tiny_moe(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny random MoE of ``family``; Qwen2/3-MoE get a dense layer (1) mixed in."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=TOP_K)  # fmt: skip
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, intermediate_size=24,
                                             num_experts=EXPERTS, mlp_only_layers=[1], norm_topk_prob=True)  # fmt: skip
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=16, intermediate_size=24,
                                             shared_expert_intermediate_size=20, num_experts=EXPERTS,
                                             mlp_only_layers=[1])  # fmt: skip
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=EXPERTS)
    else:
        config = transformers.OlmoeConfig(**common, intermediate_size=16, num_experts=EXPERTS, eos_token_id=0,
                                          pad_token_id=1)  # fmt: skip
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def moe_layers(model) -> list[int]:
    adapter = get_adapter(model)
    return [layer for layer in range(adapter.num_layers) if adapter.num_experts(layer)]


@contextlib.contextmanager
def masked_routers(model, removed: dict[int, list[int]]):
    """Within the block, the routers of ``model`` give the ``removed`` experts' logits -inf."""
    adapter = get_adapter(model)
    targets = {id(adapter.router(layer).weight): experts for layer, experts in removed.items() if experts}
    linear = torch.nn.functional.linear

    def masked(x, weight, bias=None):
        out = linear(x, weight, bias)
        experts = targets.get(id(weight))
        if experts:
            out = out.clone()
            out[..., experts] = float("-inf")
        return out

    torch.nn.functional.linear = masked
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


INPUTS = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUTS, **kwargs).logits


def expert_plans(model, uniform: bool):
    """Random expert sets: each MoE layer loses at most ``EXPERTS - TOP_K``; uniform: the same count everywhere."""
    layers = moe_layers(model)
    subsets = st.lists(st.integers(0, EXPERTS - 1), unique=True, max_size=EXPERTS - TOP_K)
    if uniform:
        return st.integers(1, EXPERTS - TOP_K).flatmap(
            lambda n: st.fixed_dictionaries(
                {layer: st.lists(st.integers(0, EXPERTS - 1), unique=True, min_size=n, max_size=n) for layer in layers}
            )
        )
    return st.fixed_dictionaries({layer: subsets for layer in layers})


_BASE: dict[str, transformers.PreTrainedModel] = {}


def fresh(family: str):
    if family not in _BASE:
        _BASE[family] = tiny_moe(family)
    return copy.deepcopy(_BASE[family])


@pytest.mark.parametrize("family", FAMILIES)
@HYPOTHESIS
@given(data=st.data())
def test_pruned_equals_masked_router_original(family, data):
    model = fresh(family)
    plan = data.draw(expert_plans(model, uniform=data.draw(st.booleans())), label="plan")
    with masked_routers(model, plan):
        reference = logits(model)
    summary = sinv_prune.prune(model, {"experts": plan})
    torch.testing.assert_close(logits(model), reference, atol=1e-5, rtol=0)
    adapter = get_adapter(model)
    for layer in moe_layers(model):
        kept = EXPERTS - len(plan[layer])
        assert adapter.num_experts(layer) == kept
        assert adapter.experts(layer).num_experts == adapter.router(layer).num_experts == kept
        assert adapter.router(layer).weight.shape[0] == kept
    record = get_record(model.config)
    if not any(plan.values()):
        assert record is None  # nothing removed: the model is left as it was
        return
    assert record.num_experts == EXPERTS
    assert record.pruned_experts == {layer: sorted(e) for layer, e in plan.items() if e}
    assert summary.experts_removed == sum(map(len, plan.values()))
    uniform = len({len(e) for e in plan.values()}) == 1
    assert record.stock_layout == uniform
    with tempfile.TemporaryDirectory() as directory:  # uniform: the stock class; uneven: through the record
        model.save_pretrained(directory)
        load = transformers.AutoModelForCausalLM.from_pretrained if uniform else sinv_prune.from_pretrained
        reloaded = load(directory).eval()
    torch.testing.assert_close(logits(reloaded), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mask_matters(family):
    """The reference is not vacuous: masking the experts the plan removes changes the unpruned output."""
    model = fresh(family)
    plan = {layer: [0, 3] for layer in moe_layers(model)}
    with masked_routers(model, plan):
        reference = logits(model)
    assert (reference - logits(model)).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_cut_reloads_on_the_stock_class_in_per_expert_keys(family, tmp_path):
    model = fresh(family)
    plan = {layer: [1, 4] for layer in moe_layers(model)}
    sinv_prune.prune(model, {"experts": plan})
    expected = logits(model)
    assert type(model) is sinv_prune.surgery.checkpoint.base_class(type(model))
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert getattr(config, get_adapter(model).config_experts_key) == EXPERTS - 2
    assert not hasattr(config, "auto_map") and config.sinv_prune["stock_layout"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    layer = moe_layers(model)[0]
    # The family's own per-expert keys (mlp.experts.<id>.gate_proj, Mixtral's block_sparse_moe.experts.<id>.w1).
    ids = {m.group(1) for n in names if (m := re.match(rf"model\.layers\.{layer}\.\w+\.experts\.(\d+)\.", n))}
    assert ids == {str(e) for e in range(EXPERTS - 2)}
    saved = json.loads((tmp_path / "config.json").read_text())["sinv_prune"]
    assert saved["num_experts"] == EXPERTS and saved["pruned_experts"] == {str(k): v for k, v in plan.items()}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no remote code
    assert type(reloaded).__name__ == type(model).__name__
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_uneven_cut_reloads_through_the_record(family, tmp_path):
    model = fresh(family)
    layers = moe_layers(model)
    sinv_prune.prune(model, {"experts": {layers[0]: [0, 2, 5], layers[-1]: [3]}})
    expected = logits(model)
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert getattr(config, get_adapter(model).config_experts_key) == EXPERTS and not config.sinv_prune["stock_layout"]
    reloaded = sinv_prune.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=0)
    again = sinv_prune.from_pretrained(tmp_path).eval()
    sinv_prune.prune(again, {"experts": {layers[0]: [0]}})  # current numbering: original expert 1
    assert get_record(again.config).pruned_experts[layers[0]] == [0, 1, 2, 5]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({0: [0, 1, 2, 3, 4]}, "experts layer 0: removing 5 of 6 experts leaves 1, fewer than num_experts_per_tok=2"),
        ({1: [0]}, "experts layer 1: a dense layer"),
        ({0: [6]}, "experts layer 0: expert indices [6] out of range 0..5"),
        ({0: [1, 1]}, "duplicate expert indices [1]"),
    ],
)
def test_refusals_leave_the_model_bit_identical(plan, message):
    model = fresh("qwen3_moe")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sinv_prune.prune(model, {"experts": plan})
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert model.config.to_dict() == config


def test_experts_refuse_compensation():
    model = fresh("mixtral")
    batches = [{"input_ids": INPUTS}]
    with pytest.raises(ValueError, match="removed experts have none"):
        sinv_prune.prune(model, {"experts": {0: [1]}}, calibration=batches, compensate="lsq")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_heads_and_layers_on_moe_models(family):
    model = fresh(family)
    reference = copy.deepcopy(model)
    adapter = get_adapter(reference)
    d = adapter.layout(0).head_dim
    with torch.no_grad():  # head 1 of layer 0 contributes nothing
        adapter.out_proj(0).weight[:, d : 2 * d] = 0
    wanted = logits(reference)
    group = adapter.layout(0).group_size
    sinv_prune.prune(model, {"heads": {0: [1] if group == 1 else [1, 3]}})  # GQA: one head per KV group
    with torch.no_grad():
        adapter.out_proj(0).weight[:, 3 * d : 4 * d] = 0
    torch.testing.assert_close(logits(model), logits(reference), atol=1e-5, rtol=0)
    del wanted
    sinv_prune.prune(model, {"layers": [2]})
    assert get_adapter(model).num_layers == LAYERS - 1 and model.config.num_hidden_layers == LAYERS - 1
    assert logits(model).isfinite().all()


def test_olmoe_refuses_heads_in_one_line():
    with pytest.raises(ValueError, match="layer 0: heads cannot be removed: OLMoE's q_norm and k_norm") as err:
        sinv_prune.prune(fresh("olmoe"), {"heads": {0: [1]}})
    assert "\n" not in str(err.value)


def test_dense_layer_channels_of_a_mixed_model_and_the_moe_layers_own_rule():
    model = fresh("qwen3_moe")
    sinv_prune.prune(model, {"mlp": {1: [0, 5]}})
    assert get_adapter(model).intermediate_size(1) == 22
    assert get_record(model.config).pruned_mlp == {1: [0, 5]}
    with pytest.raises(ValueError, match=r"mlp layer 0: every expert must lose the same number of channels"):
        sinv_prune.prune(model, {"mlp": {0: [0]}})  # MoE layers: channels inside experts (test_moe_channels.py)


@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_unsupported_moe_families_say_what_is_missing(family):
    config = transformers.AutoConfig.for_model(family)
    model = torch.nn.Module()
    model.config = config
    with pytest.raises(ValueError, match=f"unsupported architecture '{family}': .* not supported: "):
        get_adapter(model)


def test_pruner_part_defaults_to_uniform_counts_and_keeps_original_ids():
    model = fresh("qwen3_moe")
    part = sinv_prune.Part("experts", "random", 0.25)
    assert part.mode == "uniform"
    summary = sinv_prune.Pruner([part]).prune(model)
    assert [len(c.removed) for c in summary.experts] == [1, 1]  # 3 of the 12 experts, one per MoE layer (floor)
    record = get_record(model.config)
    assert record.stock_layout and sorted(record.pruned_experts) == moe_layers(model)


def test_cli_prune_experts_and_info(tmp_path):
    source, out = tmp_path / "moe", tmp_path / "pruned"
    fresh("mixtral").save_pretrained(source)
    runner = CliRunner()
    result = runner.invoke(main, ["prune", str(source), str(out), "--experts", "0:1,5;2:3"])
    assert result.exit_code == 0, result.output
    assert "experts removed" in result.output
    info = runner.invoke(main, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert "trust_remote_code" in info.output
    assert "experts kept 4/6 removed [1, 5]" in info.output and "experts kept 5/6 removed [3]" in info.output
    bad = runner.invoke(main, ["prune", str(source), str(tmp_path / "bad"), "--experts", "0:0-4"])
    assert bad.exit_code == 2 and "fewer than num_experts_per_tok=2" in bad.output
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_closed_expert_gate_is_the_removal(family):
    """Gates (Taylor, sensitivity) scale routing probabilities: a gate of 0 equals the masked-router model."""
    model = fresh(family)
    plan = {layer: [2, 5] for layer in moe_layers(model)}
    with masked_routers(model, plan):
        reference = logits(model)
    with get_unit("experts").gates(model, requires_grad=False) as gates:
        for layer, experts in plan.items():
            gates[layer][experts] = 0.0
        gated = logits(model)
        assert [g.numel() for g in gates] == [EXPERTS if layer in plan else 0 for layer in range(LAYERS)]
    torch.testing.assert_close(gated, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(model), logits(fresh(family)), atol=0, rtol=0)  # hooks gone


@pytest.mark.parametrize("allocation", ["standardized", "sensitivity", "search"])
def test_allocations_spread_an_expert_cut(allocation):
    model = fresh("qwen3_moe")
    batches = [{"input_ids": INPUTS}]
    part = sinv_prune.Part("experts", "magnitude", 4, allocation=allocation)
    assert part.mode == "global"  # the allocation spreads the cut, not the unit's uniform default
    summary = sinv_prune.Pruner([part]).prune(model, batches=batches, calibration=batches)
    removed = {c.layer: len(c.removed) for c in summary.experts}
    assert 0 < sum(removed.values()) <= 4 and all(EXPERTS - n >= TOP_K for n in removed.values())


def test_taylor_scores_experts_through_their_gates():
    model = fresh("mixtral")
    scores = get_criterion("taylor", unit="experts").compute(model, [{"input_ids": INPUTS}])
    assert [len(row) for row in scores] == [EXPERTS] * LAYERS
    assert all(any(v > 0 for v in row) for row in scores)


def test_dropping_every_moe_layer_turns_the_load_balancing_loss_off(caplog, tmp_path):
    """With no router left, transformers' load-balancing loss would index an empty tuple at every forward."""
    model = fresh("qwen3_moe")  # MoE layers 0 and 2 around dense layer 1
    model.config.output_router_logits = True
    sinv_prune.prune(model, {"layers": [2]})
    assert model.config.output_router_logits  # one MoE layer left: the loss stays
    sinv_prune.prune(model, {"layers": [0]})
    assert not model.config.output_router_logits and "no mixture-of-experts layer is left" in caplog.text
    assert moe_layers(model) == []
    out = model(INPUTS, labels=INPUTS)
    assert out.loss.isfinite() and out.aux_loss is None
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not reloaded.config.output_router_logits
    torch.testing.assert_close(reloaded(INPUTS, labels=INPUTS).loss, out.loss, atol=1e-6, rtol=0)


def test_sinv_depth_reads_a_moe_layers_c_ff_as_its_experts_mean():
    from sinv_prune.scoring.measures import head_measures

    model = fresh("qwen3_moe")
    criterion = get_criterion("sinv_depth", unit="layers")
    scores = criterion.compute(model)
    measures = head_measures(model, keys=["C_Q", "C_FF", "C_FF_experts"])
    for layer in range(LAYERS):
        experts = measures["C_FF_experts"][layer]
        c_ff = sum(experts) / len(experts) if experts else measures["C_FF"][layer]
        c_q = sum(measures["C_Q"][layer]) / len(measures["C_Q"][layer])
        assert scores[layer] == pytest.approx(-c_ff / c_q, rel=1e-6)


@pytest.mark.parametrize(
    ("family", "overrides", "drop"),
    [
        ("qwen3_moe", {}, [0]),  # mlp_only_layers=[1]: the dense layer moves to 0
        ("qwen2_moe", {}, [0]),
        ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, [0]),  # the step would hit the dense one
        ("qwen3_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, [1]),  # no MoE layer left
    ],
)
def test_dropping_layers_of_a_mixed_model_keeps_each_layers_kind_on_reload(family, overrides, drop, tmp_path):
    model = tiny_moe(family, **overrides)
    kinds = [bool(get_adapter(model).num_experts(i)) for i in range(LAYERS)]
    sinv_prune.prune(model, {"layers": drop})
    kept = [kind for i, kind in enumerate(kinds) if i not in drop]
    expected = logits(model)
    model.save_pretrained(tmp_path)
    stock, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or re-initialised weights
    for reloaded in (stock.eval(), sinv_prune.from_pretrained(tmp_path).eval()):
        adapter = get_adapter(reloaded)
        assert [bool(adapter.num_experts(i)) for i in range(adapter.num_layers)] == kept
        torch.testing.assert_close(logits(reloaded), expected, atol=1e-5, rtol=0)


def reference_aux_loss(router_logits, removed: dict[int, list[int]], layers: list[int]) -> torch.Tensor:
    """transformers' load-balancing loss over the kept experts, from the masked original's router logits: per
    MoE layer, the kept columns' softmax and top-k; the shares pooled by kept position over the layers, times the
    largest kept count ``E`` (``E * sum_j f_j P_j``; f: the share of top-k picks, P: the mean probability; a layer
    keeping fewer than ``E`` adds nothing past its own count)."""
    width = max(EXPERTS - len(removed.get(layer, [])) for layer in layers)
    picks = torch.zeros(width, dtype=torch.float64)
    probs = torch.zeros(width, dtype=torch.float64)
    for logits_, layer in zip(router_logits, layers, strict=True):
        kept = [e for e in range(EXPERTS) if e not in removed.get(layer, [])]
        p = torch.softmax(logits_[:, kept].double(), dim=-1)
        for j in torch.topk(p, TOP_K, dim=-1).indices.flatten().tolist():
            picks[j] += 1
        probs[: len(kept)] += p.sum(dim=0)
    rows = router_logits[0].shape[0] * len(layers)
    return width * ((picks / rows) * (probs / rows)).sum()


def masked_loss(model, removed: dict[int, list[int]], heads: tuple[int, ...] = ()):
    """The original's output with labels, its routers masked and query ``heads`` of layer 0 zeroed, and its
    cross-entropy alone (the loss less the router's aux loss)."""
    reference = copy.deepcopy(model)
    adapter = get_adapter(reference)
    d = adapter.layout(0).head_dim
    with torch.no_grad():
        for head in heads:
            adapter.out_proj(0).weight[:, head * d : (head + 1) * d] = 0
    with masked_routers(reference, removed), torch.no_grad():
        out = reference(INPUTS, labels=INPUTS)
    return out, out.loss - reference.config.router_aux_loss_coef * out.aux_loss


def assert_loss(pruned, out, cross_entropy, aux) -> None:
    with torch.no_grad():
        got = pruned(INPUTS, labels=INPUTS)
    torch.testing.assert_close(got.aux_loss.double(), aux, atol=1e-5, rtol=0)
    expected = cross_entropy + pruned.config.router_aux_loss_coef * got.aux_loss
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.logits, out.logits, atol=1e-5, rtol=0)


def test_an_even_expert_cut_beside_uneven_heads_keeps_the_load_balancing_loss(tmp_path):
    """Uneven heads take the remote-code route; the expert count the config and the model state is the layers' one,
    so the loss with labels (cross-entropy plus the router's aux loss) is the masked original's cross-entropy plus
    the aux loss over the kept experts, before and after a reload."""
    model = fresh("qwen3_moe")
    model.config.output_router_logits = True
    removed = {0: [0, 1], 2: [3, 4]}
    out, cross_entropy = masked_loss(model, removed, heads=(1, 3))
    aux = reference_aux_loss(out.router_logits, removed, moe_layers(model))
    sinv_prune.prune(model, {"experts": removed, "heads": {0: [1, 3]}})
    assert not get_record(model.config).stock_layout
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path, trust_remote_code=True).num_experts == EXPERTS - 2
    for pruned in (model, sinv_prune.from_pretrained(tmp_path).eval()):
        assert pruned.num_experts == pruned.config.num_experts == EXPERTS - 2
        assert_loss(pruned, out, cross_entropy, aux)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_uneven_expert_counts_keep_the_load_balancing_loss(family, tmp_path):
    """Layers keeping different counts: the aux loss is transformers' formula over router logits padded with
    never-chosen experts to the largest count, recomputed here from the masked original's logits."""
    model = fresh(family)
    model.config.output_router_logits = True
    layers = moe_layers(model)
    removed = {layers[0]: [1], layers[-1]: [1, 2]}
    out, cross_entropy = masked_loss(model, removed)
    aux = reference_aux_loss(out.router_logits, removed, layers)
    sinv_prune.prune(model, {"experts": removed})
    assert model.config.output_router_logits and not get_record(model.config).stock_layout
    model.save_pretrained(tmp_path)
    for pruned in (model, sinv_prune.from_pretrained(tmp_path).eval()):
        assert getattr(pruned.config, get_adapter(pruned).config_experts_key) == EXPERTS  # the rebuild's count
        assert pruned.num_experts == max(EXPERTS - len(removed.get(layer, [])) for layer in layers)
        assert_loss(pruned, out, cross_entropy, aux)
        with torch.no_grad():  # the padding is the aux loss's only: the routers' own logits keep their widths
            assert get_adapter(pruned).router(layers[-1])(torch.randn(3, 32)).__getitem__(0).shape == (3, EXPERTS - 2)
    adapter = get_adapter(model)  # now one count again: no padding, the stock formula
    sinv_prune.prune(
        model, {"experts": {layer: list(range(adapter.num_experts(layer) - EXPERTS + 2)) for layer in layers}}
    )
    assert model.num_experts == getattr(model.config, adapter.config_experts_key) == EXPERTS - 2
    with torch.no_grad():
        widths = {t.shape[-1] for t in model(INPUTS, output_router_logits=True).router_logits}
    assert widths == {EXPERTS - 2}


@pytest.mark.parametrize("family", FAMILIES)
def test_open_expert_gates_leave_a_bf16_model_bit_identical(family):
    """The gates' re-routing keeps each family's dtypes (Mixtral's top-k weights stay float32, the others' are
    cast to the logits' dtype), so in bfloat16 open gates compute the plain model's logits exactly."""
    model = fresh(family).to(torch.bfloat16)
    plain = logits(model)
    with get_unit("experts").gates(model, requires_grad=False):
        gated = logits(model)
    assert torch.equal(gated, plain), (gated.float() - plain.float()).abs().max()


def test_a_second_expert_cut_records_original_ids_and_reloads(tmp_path):
    """A cut of an already cut layer names experts in current numbering; the record keeps original ids (current
    [0, 2] after removing [0, 1] are originals 2 and 4), which the remote-code rebuild slices by on reload."""
    model = fresh("qwen3_moe")
    layer = moe_layers(model)[0]
    with masked_routers(model, {layer: [0, 1, 2, 4]}):
        expected = logits(model)
    sinv_prune.prune(model, {"experts": {layer: [0, 1]}})
    sinv_prune.prune(model, {"experts": {layer: [0, 2]}})
    assert get_record(model.config).pruned_experts[layer] == [0, 1, 2, 4]
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(logits(sinv_prune.from_pretrained(tmp_path).eval()), expected, atol=1e-5, rtol=0)


def test_every_moe_layer_keeps_num_experts_per_tok():
    """The most a selection may remove is every MoE layer down to ``num_experts_per_tok``: one more is refused in one
    line, and that many leaves exactly top-k experts in each MoE layer."""
    model = fresh("qwen3_moe")
    most = (EXPERTS - TOP_K) * len(moe_layers(model))
    refusal = rf"^amount {most + 1} is larger than the {most} experts that may be removed "
    refusal += rf"with min_experts_per_layer={TOP_K}$"
    with pytest.raises(ValueError, match=refusal):
        sinv_prune.Pruner([sinv_prune.Part("experts", "random", most + 1, mode="global")]).prune(model)
    summary = sinv_prune.Pruner([sinv_prune.Part("experts", "random", most, mode="global")]).prune(model)
    assert {c.layer: c.kept for c in summary.experts} == dict.fromkeys(moe_layers(model), TOP_K)


@pytest.mark.parametrize(
    ("drop", "mlp_only", "step", "expected"),
    [
        ([0, 1], [2], 2, ([0], 2)),  # kept: old 2 (dense, listed) and 3 (MoE): the step still lands
        ([1], [], 2, ([0, 1], 1)),  # kept: dense, dense, MoE: no step does, so the dense layers are listed
    ],
)
def test_dropped_blocks_renumber_mlp_only_layers_and_keep_a_step_that_still_lands(drop, mlp_only, step, expected):
    """Qwen3-MoE, 4 blocks (dense where listed or ``(i + 1) % step``): the renumbered config describes each kept
    block's kind (recomputed here from the original kinds), with the step kept where it still lands."""
    model = tiny_moe("qwen3_moe", num_hidden_layers=4, mlp_only_layers=mlp_only, decoder_sparse_step=step)
    kinds = [bool(get_adapter(model).num_experts(i)) for i in range(4)]
    assert kinds == [not (i in mlp_only or (i + 1) % step) for i in range(4)]
    sinv_prune.prune(model, {"layers": drop})
    config = model.config
    kept = [kind for i, kind in enumerate(kinds) if i not in drop]
    described = [not (j in config.mlp_only_layers or (j + 1) % config.decoder_sparse_step) for j in range(len(kept))]
    assert described == kept
    assert (config.mlp_only_layers, config.decoder_sparse_step) == expected
