"""GPT-OSS: experts, heads (with their attention sinks) and layers removed exactly; the reload routes; the
expert criteria against direct computations with transformers' own modules; the GGUF refusal.

Exact means, for experts: the pruned model computes what the original computes when its routers give the
removed experts' logits -inf (GPT-OSS takes the top k of the logits, then a softmax over those k); for
heads: what the original computes with those heads' ``o_proj`` columns zeroed, whatever their sinks hold.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_experts import INPUTS, expert_plans, logits, masked_routers

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.cli import main
from sinv_prune.deploy.errors import ExportRefused
from sinv_prune.deploy.gguf_layout import check_exportable
from sinv_prune.scoring.criteria import get_criterion
from sinv_prune.scoring.measures import c_square, expert_measures, head_measures
from sinv_prune.surgery.record import get_record
from sinv_prune.units import get_unit

EXPERTS, TOP_K, LAYERS, HEADS, KV, HEAD_DIM = 6, 2, 3, 4, 2, 8
HYPOTHESIS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tiny_gpt_oss(seed: int = 0, experts_implementation: str | None = None) -> transformers.GptOssForCausalLM:
    """A tiny random GPT-OSS: layers sliding, full, sliding (window 4 of 12 tokens), every weight N(0, 0.3)."""
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        head_dim=HEAD_DIM, intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=64, sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


_BASE: list[transformers.GptOssForCausalLM] = []


def fresh() -> transformers.GptOssForCausalLM:
    if not _BASE:
        _BASE.append(tiny_gpt_oss())
    return copy.deepcopy(_BASE[0])


def test_the_tiny_model_has_what_makes_gpt_oss_different():
    model = fresh()
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    adapter = get_adapter(model)
    assert type(adapter).__name__ == "GptOssAdapter" and adapter.top_k() == TOP_K
    attn, block = adapter.attention(0), adapter.moe_block(0)
    assert attn.sinks.shape == (HEADS,) and attn.o_proj.bias is not None
    assert block.router.bias.shape == (EXPERTS,) and block.experts.gate_up_proj.shape == (EXPERTS, 32, 32)
    assert [adapter.num_experts(i) for i in range(LAYERS)] == [EXPERTS] * LAYERS and adapter.expert_width(0) == 16
    assert adapter.intermediate_size(0) == 0  # no dense MLP channels


# -- experts --------------------------------------------------------------------------------------


@HYPOTHESIS
@given(data=st.data())
def test_pruned_equals_masked_router_original(data):
    model = fresh()
    plan = data.draw(expert_plans(model, uniform=data.draw(st.booleans())), label="plan")
    with masked_routers(model, plan):
        reference = logits(model)
    summary = sinv_prune.prune(model, {"experts": plan})
    torch.testing.assert_close(logits(model), reference, atol=1e-5, rtol=0)
    adapter = get_adapter(model)
    for layer in range(LAYERS):
        kept = EXPERTS - len(plan[layer])
        experts, router = adapter.experts(layer), adapter.router(layer)
        assert adapter.num_experts(layer) == experts.num_experts == router.num_experts == kept
        assert router.weight.shape[0] == router.bias.shape[0] == kept
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            assert getattr(experts, name).shape[0] == kept, name
    if not any(plan.values()):
        assert get_record(model.config) is None
        return
    record = get_record(model.config)
    assert record.num_experts == EXPERTS and summary.experts_removed == sum(map(len, plan.values()))
    assert record.pruned_experts == {layer: sorted(e) for layer, e in plan.items() if e}


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_runs_the_pruned_model_exactly(implementation):
    model = tiny_gpt_oss(experts_implementation=implementation)
    plan = {0: [0, 3], 1: [5], 2: [1, 2, 4]}
    with masked_routers(model, plan):
        reference = logits(model)
    assert (reference - logits(model)).abs().max() > 1e-3  # the mask matters: the reference is not vacuous
    sinv_prune.prune(model, {"experts": plan})
    torch.testing.assert_close(logits(model), reference, atol=1e-5, rtol=0)


def test_router_bias_is_sliced_with_the_weight():
    """A large bias on an expert that stays makes it always picked; removing other experts keeps that."""
    model = fresh()
    with torch.no_grad():
        get_adapter(model).router(0).bias[4] = 100.0
    sinv_prune.prune(model, {"experts": {0: [0, 1]}})
    assert get_adapter(model).router(0).bias[2] == 100.0
    seen = []
    hook = get_adapter(model).router(0).register_forward_hook(lambda m, a, out: seen.append(out[2]))
    logits(model)
    hook.remove()
    assert (seen[0] == 2).any(dim=-1).all()


def test_too_many_experts_are_refused_and_the_model_is_bit_identical():
    model = fresh()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with pytest.raises(ValueError, match=r"experts layer 1: removing 5 of 6 experts leaves 1, fewer than "):
        sinv_prune.prune(model, {"experts": {0: [0], 1: [0, 1, 2, 3, 4]}})
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert model.config.to_dict() == config and get_record(model.config) is None


def test_uniform_cut_reloads_on_the_stock_class(tmp_path):
    model = fresh()
    plan = {layer: [1, 4] for layer in range(LAYERS)}
    sinv_prune.prune(model, {"experts": plan, "heads": {layer: [1, 3] for layer in range(LAYERS)}})
    expected = logits(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["num_local_experts"] == EXPERTS - 2 and saved["num_attention_heads"] == HEADS - 2
    assert "auto_map" not in saved and saved["sinv_prune"]["stock_layout"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no remote code
    assert type(reloaded) is transformers.GptOssForCausalLM
    assert reloaded.model.layers[0].self_attn.sinks.shape == (HEADS - 2,)
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=0)


def test_uneven_cut_reloads_through_the_record(tmp_path):
    model = fresh()
    sinv_prune.prune(model, {"experts": {0: [0, 2, 5], 2: [3]}, "heads": {1: [0, 3]}})
    expected = logits(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["num_local_experts"] == EXPERTS and not saved["sinv_prune"]["stock_layout"]
    reloaded = sinv_prune.from_pretrained(tmp_path).eval()
    assert [get_adapter(reloaded).num_experts(i) for i in range(LAYERS)] == [3, 6, 5]
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=0)
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(logits(remote), expected, atol=1e-6, rtol=0)


# -- heads and layers -----------------------------------------------------------------------------


def _equal_groups(removed: list[int]) -> bool:
    """At least one head kept, and the KV groups that keep any keep the same number (GQA stays expressible)."""
    group = HEADS // KV
    kept = [sum(1 for h in range(g * group, (g + 1) * group) if h not in removed) for g in range(KV)]
    return len({k for k in kept if k}) == 1


def head_plans():
    """Per layer a set of query heads whose removal leaves equal GQA groups (whole groups may go)."""
    subsets = st.lists(st.integers(0, HEADS - 1), unique=True, max_size=HEADS - 1).filter(_equal_groups)
    return st.fixed_dictionaries({layer: subsets for layer in range(LAYERS)})


@HYPOTHESIS
@given(plan=head_plans(), sink=st.floats(-8, 8))
def test_heads_equal_the_original_with_their_o_columns_zeroed_whatever_their_sinks(plan, sink):
    model = fresh()
    reference = copy.deepcopy(model)
    adapter = get_adapter(reference)
    with torch.no_grad():
        for layer, heads in plan.items():
            for h in heads:
                adapter.out_proj(layer).weight[:, h * HEAD_DIM : (h + 1) * HEAD_DIM] = 0
                adapter.attention(layer).sinks[h] = sink  # a removed head's sink changes nothing
    wanted = logits(reference)
    sinks = [adapter.attention(layer).sinks.detach().clone() for layer in range(LAYERS)]
    sinv_prune.prune(model, {"heads": plan})
    torch.testing.assert_close(logits(model), wanted, atol=1e-5, rtol=0)
    pruned = get_adapter(model)
    for layer, heads in plan.items():
        kept = [h for h in range(HEADS) if h not in heads]
        assert pruned.layout(layer).num_heads == len(kept)
        torch.testing.assert_close(pruned.attention(layer).sinks.detach(), sinks[layer][kept], atol=0, rtol=0)


def test_a_kept_heads_sink_matters():
    """The sinks are read: changing a kept head's sink changes the output (so slicing them is tested)."""
    model = fresh()
    sinv_prune.prune(model, {"heads": {0: [1, 3]}})
    before = logits(model)
    with torch.no_grad():
        get_adapter(model).attention(0).sinks[1] += 3.0  # original head 2
    assert (logits(model) - before).abs().max() > 1e-3


def test_a_layer_without_heads_keeps_the_o_bias():
    model = fresh()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        get_adapter(reference).out_proj(1).weight.zero_()
    sinv_prune.prune(model, {"heads": {1: list(range(HEADS))}}, allow_empty_layers=True)
    assert get_adapter(model).layout(1).num_heads == 0
    torch.testing.assert_close(logits(model), logits(reference), atol=1e-5, rtol=0)


def test_generation_with_the_cache_matches_after_heads_and_experts_go():
    """Greedy generation (KV cache, sliding and full layers) of a model whose sliding layer 0 lost every head,
    layer 1 two heads and every layer two experts equals the original with those heads zeroed and routers masked."""
    model = fresh()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        get_adapter(reference).out_proj(0).weight.zero_()
        get_adapter(reference).out_proj(1).weight[:, HEAD_DIM : 2 * HEAD_DIM] = 0
        get_adapter(reference).out_proj(1).weight[:, 3 * HEAD_DIM :] = 0
    experts = {layer: [2, 5] for layer in range(LAYERS)}
    sinv_prune.prune(model, {"heads": {0: list(range(HEADS)), 1: [1, 3]}, "experts": experts}, allow_empty_layers=True)
    prompt = INPUTS[:1, :6]
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad(), masked_routers(reference, experts):
        wanted = reference.generate(prompt, **settings, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = model.generate(prompt, **settings, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, wanted.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(wanted.logits), atol=1e-5, rtol=0)


def test_whole_layers_follow_the_layer_types():
    model = fresh()
    reference = copy.deepcopy(model)
    reference.model.layers[1].forward = lambda hidden_states, *args, **kwargs: hidden_states  # layer 1 skipped
    sinv_prune.prune(model, {"layers": [1]})
    assert model.config.num_hidden_layers == LAYERS - 1
    assert model.config.layer_types == ["sliding_attention", "sliding_attention"]
    torch.testing.assert_close(logits(model), logits(reference), atol=1e-5, rtol=0)


# -- criteria -------------------------------------------------------------------------------------


def moe_inputs(model) -> dict[int, torch.Tensor]:
    """Per layer, the tokens its MoE block receives, ``[tokens, hidden]``."""
    adapter, seen = get_adapter(model), {}
    hooks = [
        adapter.moe_block(layer).register_forward_pre_hook(
            lambda m, args, layer=layer: seen.__setitem__(layer, args[0].reshape(-1, args[0].shape[-1]))
        )
        for layer in range(adapter.num_layers)
    ]
    try:
        logits(model)
    finally:
        for h in hooks:
            h.remove()
    return seen


def direct_routing(model, renormalize: bool) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer and expert, with transformers' own router and experts forward on the routed tokens (float64):
    routed count, sum of output norms, sum of gate x norm; the gate is the softmax over all logits, or with
    ``renormalize`` the router's own weight (the softmax over the top-k logits)."""
    model = copy.deepcopy(model).double()
    model.set_experts_implementation("eager")
    adapter, out = get_adapter(model), {}
    for layer, x in moe_inputs(model).items():
        router, experts = adapter.router(layer), adapter.experts(layer)
        with torch.no_grad():
            router_logits, weights, index = router(x)
        probs = torch.softmax(router_logits, dim=-1)
        stats = {k: torch.zeros(EXPERTS, dtype=torch.float64) for k in ("routed", "norm", "gated")}
        for t in range(x.shape[0]):
            for slot in range(TOP_K):
                e = int(index[t, slot])
                with torch.no_grad():  # the expert alone, weight 1
                    y = experts(x[t : t + 1], torch.tensor([[e]]), torch.ones(1, 1, dtype=torch.float64))
                norm = y.norm()
                stats["routed"][e] += 1
                stats["norm"][e] += norm
                stats["gated"][e] += (weights[t, slot] if renormalize else probs[t, e]) * norm
        out[layer] = stats
    return out


@pytest.mark.parametrize("renormalize", [False, True])
def test_reap_ean_and_frequency_equal_a_direct_computation(renormalize):
    model = fresh()
    batch = {"input_ids": INPUTS}
    reap = get_criterion("reap", unit="experts", renormalize=renormalize).compute(model, [batch])
    ean = get_criterion("ean", unit="experts").compute(model, [batch])
    frequency = get_criterion("frequency", unit="experts").compute(model, [batch])
    for layer, stats in direct_routing(model, renormalize).items():
        assert stats["routed"].sum() == TOP_K * INPUTS.numel()
        mean = torch.where(stats["routed"] > 0, stats["gated"] / stats["routed"].clamp_min(1), 0.0)
        assert reap[layer] == pytest.approx(mean.tolist(), rel=1e-4, abs=1e-7)
        assert ean[layer] == pytest.approx(stats["norm"].tolist(), rel=1e-4, abs=1e-7)
        assert frequency[layer] == pytest.approx((stats["routed"] / INPUTS.numel()).tolist())


def test_expert_output_is_the_experts_forward():
    model = fresh()
    adapter = get_adapter(model)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    for e in (0, 4):
        with torch.no_grad():
            own = adapter.experts(1)(x, torch.full((5, 1), e), torch.ones(5, 1))
        torch.testing.assert_close(adapter.expert_output(1, e, x), own, atol=1e-5, rtol=1e-5)


def test_magnitude_and_sinv_static_read_the_interleaved_weights():
    model = fresh()
    adapter = get_adapter(model)
    magnitude = get_criterion("magnitude", unit="experts").compute(model)
    sinv = get_criterion("sinv_static", unit="experts").compute(model)
    assert sinv == expert_measures(model) == head_measures(model)["C_FF_experts"]
    for layer in range(LAYERS):
        experts = adapter.experts(layer)
        for e in range(EXPERTS):
            gate_up, down = experts.gate_up_proj[e].detach().double(), experts.down_proj[e].detach().double()
            w_gate, w_up, w_down = adapter.expert_mlp(layer, e)
            assert torch.equal(w_gate, gate_up[:, 0::2].T.float()) and torch.equal(w_up, gate_up[:, 1::2].T.float())
            assert torch.equal(w_down, down.T.float())
            assert magnitude[layer][e] == pytest.approx(float(torch.cat([gate_up.flatten(), down.flatten()]).norm()))
            # x -> up -> down: W_down W_up = down_proj^T (gate_up_proj[:, 1::2])^T
            assert sinv[layer][e] == pytest.approx(float(c_square(down.T @ gate_up[:, 1::2].T)), abs=1e-6)


def test_a_closed_expert_gate_is_the_removal_and_taylor_scores_experts():
    """Gates (taylor, sensitivity, search) re-route as GPT-OSS does: a gate of 0 equals the masked router, and
    open gates leave the model as it is."""
    model = fresh()
    plan = {layer: [2, 5] for layer in range(LAYERS)}
    with masked_routers(model, plan):
        reference = logits(model)
    with get_unit("experts").gates(model, requires_grad=False) as gates:
        ungated = logits(model)
        for layer, experts in plan.items():
            gates[layer][experts] = 0.0
        gated = logits(model)
    torch.testing.assert_close(ungated, logits(fresh()), atol=0, rtol=0)
    torch.testing.assert_close(gated, reference, atol=1e-5, rtol=0)
    scores = get_criterion("taylor", unit="experts").compute(model, [{"input_ids": INPUTS}])
    assert [len(row) for row in scores] == [EXPERTS] * LAYERS and all(any(v > 0 for v in row) for row in scores)


def test_random_scores_every_expert_and_a_pruner_uses_the_criteria():
    model = fresh()
    scores = get_criterion("random", unit="experts").compute(model)
    assert [len(row) for row in scores] == [EXPERTS] * LAYERS
    summary = sinv_prune.Pruner([sinv_prune.Part("experts", "reap", 6)]).prune(model, batches=[{"input_ids": INPUTS}])
    assert summary.experts_removed == 6 and [get_adapter(model).num_experts(i) for i in range(LAYERS)] == [4] * 3
    assert logits(model).isfinite().all()


# -- GGUF -----------------------------------------------------------------------------------------


def test_gguf_export_is_refused_in_one_line(tmp_path):
    with pytest.raises(ExportRefused, match="cannot export gpt_oss to GGUF: llama.cpp has a gpt-oss") as err:
        check_exportable(fresh())
    assert "\n" not in str(err.value)
    fresh().save_pretrained(tmp_path / "gpt-oss")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "gpt-oss"), str(tmp_path / "m.gguf"), "--no-vocab"])
    assert result.exit_code == 2 and result.output.splitlines()[-1].startswith("error: cannot export gpt_oss")
    assert not (tmp_path / "m.gguf").exists()
