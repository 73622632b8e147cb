"""MLP channels inside experts: exact cuts on all four MoE families, refusals, reload routes, composition with
expert removal, selection through the Pruner, GGUF export.

Exact means: the pruned model computes what the original computes with the removed channels' down-projection
columns zeroed (routed experts' ``down_proj[e][:, c]``, the shared expert's ``down_proj.weight[:, c]``, a dense
layer's down projection), and with removed experts' router logits -inf where experts went too.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from test_experts import EXPERTS, FAMILIES, HYPOTHESIS, INPUTS, logits, masked_routers, moe_layers, tiny_moe

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.cli import main
from sinv_prune.surgery.checkpoint import base_class
from sinv_prune.surgery.record import get_record
from sinv_prune.units import get_unit

WIDTH = 32  # expert width; a cut expert keeps a multiple of 8 (transformers' grouped_mm kernel)
SHARED = 20  # Qwen2-MoE's shared expert
DENSE = 24  # Qwen2/3-MoE's dense layer 1
_BASE: dict[str, transformers.PreTrainedModel] = {}


ALL = (*FAMILIES, "gpt_oss")  # GPT-OSS: transposed, interleaved gate/up, biased experts


def tiny_gpt_oss(implementation: str | None = None) -> transformers.GptOssForCausalLM:
    """test_gpt_oss's tiny GPT-OSS with experts of WIDTH channels."""
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=WIDTH, num_local_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=64, sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def fresh(family: str):
    if family not in _BASE:
        key = "moe_intermediate_size" if family.startswith("qwen") else "intermediate_size"
        _BASE[family] = tiny_gpt_oss() if family == "gpt_oss" else tiny_moe(family, **{key: WIDTH})
    return copy.deepcopy(_BASE[family])


def zeroed(model, channels: dict[int, list[int]]):
    """A copy of ``model`` whose channels (the mlp unit's items, current numbering) have zero down columns."""
    out = copy.deepcopy(model)
    adapter = get_adapter(out)
    with torch.no_grad():
        for layer, items in channels.items():
            if not adapter.num_experts(layer):
                adapter.mlp_out(layer).weight[:, items] = 0
                continue
            width, base = adapter.expert_width(layer), adapter.num_experts(layer) * adapter.expert_width(layer)
            down = adapter.expert_weights(layer)[2]  # [E, H, I] views of the fused tensors, whatever the layout
            for item in items:
                if item < base:
                    down[item // width][:, item % width] = 0
                else:
                    adapter.shared_expert(layer).down_proj.weight[:, item - base] = 0
    return out


def expert_channel_plan(model, per_expert: int, shared: int = 0, seed: int = 0) -> dict[int, list[int]]:
    """Every MoE layer: ``per_expert`` channels from each expert (each its own), ``shared`` of the shared one."""
    adapter, generator = get_adapter(model), torch.Generator().manual_seed(seed)
    plan = {}
    for layer in moe_layers(model):
        count, width = adapter.num_experts(layer), adapter.expert_width(layer)
        items = [
            e * width + int(c) for e in range(count) for c in torch.randperm(width, generator=generator)[:per_expert]
        ]
        if adapter.shared_width(layer):
            items += [
                count * width + int(c)
                for c in torch.randperm(adapter.shared_width(layer), generator=generator)[:shared]
            ]
        plan[layer] = sorted(items)
    return plan


def same_state(model, state, config) -> bool:
    after = model.state_dict()
    return (
        state.keys() == after.keys()
        and all(torch.equal(state[k], after[k]) for k in state)
        and (model.config.to_dict() == config)
    )


@st.composite
def channel_plans(draw, model):
    """Per MoE layer a per-expert count (kept widths multiples of 8), each expert its own channels, a share of the
    shared expert; the dense layer of Qwen2/3-MoE some channels too."""
    adapter = get_adapter(model)
    plan = {}
    for layer in range(adapter.num_layers):
        if not adapter.num_experts(layer):
            plan[layer] = draw(st.lists(st.integers(0, DENSE - 1), unique=True, max_size=DENSE - 1), label="dense")
            continue
        per_expert = draw(st.sampled_from([0, 8, 16, 24]), label=f"per expert {layer}")
        items = []
        for e in range(EXPERTS):
            chosen = draw(st.lists(st.integers(0, WIDTH - 1), unique=True, min_size=per_expert, max_size=per_expert))
            items += [e * WIDTH + c for c in chosen]
        if adapter.shared_width(layer):
            shared = draw(st.lists(st.integers(0, SHARED - 1), unique=True, max_size=SHARED - 1), label="shared")
            items += [EXPERTS * WIDTH + c for c in shared]
        plan[layer] = items
    return plan


@pytest.mark.parametrize("family", ALL)
@HYPOTHESIS
@given(data=st.data())
def test_pruned_equals_the_original_with_those_down_columns_zeroed(family, data):
    model = fresh(family)
    plan = data.draw(channel_plans(model), label="plan")
    reference = logits(zeroed(model, plan))
    summary = sinv_prune.prune(model, {"mlp": plan})
    torch.testing.assert_close(logits(model), reference, atol=1e-5, rtol=0)
    adapter = get_adapter(model)
    for layer in moe_layers(model):
        kept = WIDTH - sum(1 for i in plan[layer] if i < EXPERTS * WIDTH) // EXPERTS
        assert adapter.expert_width(layer) == kept
        gate, up, down = adapter.expert_weights(layer)
        assert gate.shape == up.shape == (EXPERTS, kept, 32) and down.shape == (EXPERTS, 32, kept)
        shared = sum(1 for i in plan[layer] if i >= EXPERTS * WIDTH)
        assert adapter.shared_width(layer) == (SHARED - shared if family == "qwen2_moe" else 0)
    assert summary.channels_removed == sum(map(len, plan.values()))
    record = get_record(model.config)
    if record is not None:
        moe = {layer: sorted(v) for layer, v in plan.items() if v and layer in moe_layers(model)}
        assert record.pruned_expert_channels == moe  # an unpruned model: original numbering is current numbering
        assert record.expert_width == (WIDTH if moe else None)  # uncut experts: the record reads as before


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_every_experts_implementation_runs_the_cut_exactly(family, implementation):
    """transformers' three expert forwards on the cut weights (grouped_mm: the alignment rule's reason)."""
    model = tiny_gpt_oss(implementation) if family == "gpt_oss" else fresh(family)
    model.set_experts_implementation(implementation)
    plan = expert_channel_plan(model, 8)
    plan[moe_layers(model)[-1]] = expert_channel_plan(model, 24, seed=1)[moe_layers(model)[-1]]
    reference = logits(zeroed(model, plan))
    assert (reference - logits(model)).abs().max() > 1e-3  # the zeroed columns matter
    sinv_prune.prune(model, {"mlp": plan})
    torch.testing.assert_close(logits(model), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({0: [0]}, r"mlp layer 0: every expert must lose the same number of channels .*; per-expert counts \[1, 0"),
        ({0: [e * WIDTH + c for e in range(EXPERTS) for c in range(WIDTH)]}, "removing all 32 channels of every"),
        (
            {0: [e * WIDTH for e in range(EXPERTS)]},
            "the experts would keep 31 channels; a cut expert keeps a multiple of 8",
        ),
        ({0: [EXPERTS * WIDTH + c for c in range(SHARED)]}, "removing all 20 channels of the shared expert"),
        (
            {0: [EXPERTS * WIDTH + SHARED]},
            r"channel indices \[212\] out of range 0..211 \(6 experts of 32 channels, then",
        ),
        ({1: [DENSE]}, r"mlp layer 1: channel indices \[24\] out of range 0..23"),
    ],
)
def test_refusals_are_one_line_and_leave_the_model_bit_identical(plan, message):
    model = fresh("qwen2_moe")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with pytest.raises(ValueError, match=message) as err:
        sinv_prune.prune(model, {"mlp": plan})
    assert "\n" not in str(err.value)
    assert same_state(model, state, config)


def test_compensation_is_refused_for_channels_inside_experts():
    model = fresh("mixtral")
    state, config = {k: v.clone() for k, v in model.state_dict().items()}, model.config.to_dict()
    refusal = r"compensate='lsq' refits a dense MLP's down projection; layers \[0, 1, 2\] cut channels inside experts"
    with pytest.raises(ValueError, match=refusal):
        sinv_prune.prune(
            model, {"mlp": expert_channel_plan(model, 8)}, calibration=[{"input_ids": INPUTS}], compensate="lsq"
        )
    assert same_state(model, state, config)


@pytest.mark.parametrize("family", ALL)
def test_uniform_widths_reload_on_the_stock_class(family, tmp_path):
    model = fresh(family)
    sinv_prune.prune(model, {"mlp": expert_channel_plan(model, 16, shared=5)})
    expected = logits(model)
    assert type(model) is base_class(type(model))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    adapter = get_adapter(model)
    assert saved[adapter.config_expert_width_key] == 16 and saved["sinv_prune"]["stock_layout"]
    assert saved["sinv_prune"]["expert_width"] == WIDTH and "auto_map" not in saved
    if family == "qwen2_moe":
        assert saved["shared_expert_intermediate_size"] == SHARED - 5
    if family.startswith("qwen"):
        assert saved["intermediate_size"] == DENSE  # the dense layer's width is not the experts'
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no remote code
    assert type(reloaded).__name__ == type(model).__name__
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_uneven_widths_reload_through_the_record_and_compose(family, tmp_path):
    model = fresh(family)
    layers = moe_layers(model)
    plan = expert_channel_plan(model, 8, shared=3)
    plan[layers[-1]] = expert_channel_plan(model, 16, seed=1)[layers[-1]]
    sinv_prune.prune(model, {"mlp": plan})
    expected = logits(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[get_adapter(model).config_expert_width_key] == WIDTH and not saved["sinv_prune"]["stock_layout"]
    reloaded = sinv_prune.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=0)
    assert [get_adapter(reloaded).expert_width(i) for i in layers] == [24] * (len(layers) - 1) + [16]
    # Current numbering after the cut: expert 2's current channel 0 is its first kept original channel.
    record = get_record(reloaded.config)
    first = record.kept_expert_channels(layers[0], 2)[:8]
    sinv_prune.prune(reloaded, {"mlp": {layers[0]: [e * 24 + c for e in range(EXPERTS) for c in range(8)]}})
    assert set(get_record(reloaded.config).pruned_expert_channels[layers[0]]) >= {2 * WIDTH + c for c in first}
    assert get_adapter(reloaded).expert_width(layers[0]) == 16


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
@pytest.mark.parametrize("order", ["channels then experts", "experts then channels"])
def test_composes_with_expert_removal_either_way(family, order, tmp_path):
    model = fresh(family)
    layers = moe_layers(model)
    removed = {layers[0]: [1, 4]}
    channels = expert_channel_plan(model, 8, shared=2)
    if order == "channels then experts":
        reference = zeroed(model, channels)
        sinv_prune.prune(model, {"mlp": channels})
        sinv_prune.prune(model, {"experts": removed})
    else:
        sinv_prune.prune(model, {"experts": removed})
        reference = copy.deepcopy(model)  # experts gone; the channel plan is in the new expert numbering
        channels = expert_channel_plan(model, 8, shared=2)
        reference = zeroed(reference, channels)
        sinv_prune.prune(model, {"mlp": channels})
    record = get_record(model.config)
    assert record.kept_experts(layers[0]) == [0, 2, 3, 5]
    kept_items = record.kept_moe_items(layers[0])
    assert len(kept_items) == 4 * 24 + (SHARED - 2 if family == "qwen2_moe" else 0)
    assert all(item // WIDTH in (0, 2, 3, 5) for item in kept_items if item < EXPERTS * WIDTH)
    with masked_routers(reference, removed if order == "channels then experts" else {}):
        expected = logits(reference)
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path)  # uneven expert counts: remote code, rebuilt from the record
    assert not get_record(model.config).stock_layout
    torch.testing.assert_close(logits(sinv_prune.from_pretrained(tmp_path).eval()), expected, atol=1e-6, rtol=0)


def test_one_plan_cuts_channels_and_experts_of_a_layer():
    model = fresh("qwen3_moe")
    channels = expert_channel_plan(model, 8)
    reference = zeroed(model, channels)
    sinv_prune.prune(model, {"mlp": channels, "experts": {0: [3]}})  # both in the numbering before the call
    with masked_routers(reference, {0: [3]}):
        expected = logits(reference)
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=0)
    record = get_record(model.config)
    assert record.pruned_experts == {0: [3]} and record.pruned_expert_channels == channels


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_pruner_magnitude_removes_each_experts_weakest_channels(family):
    model = fresh(family)
    scores = sinv_prune.get_criterion("magnitude", unit="mlp").compute(model)
    adapter = get_adapter(model)
    summary = sinv_prune.Pruner([sinv_prune.Part("mlp", "magnitude", 0.25)]).prune(model)
    cut = [c.layer for c in summary.mlp if c.layer in moe_layers(model)]
    assert cut, summary.mlp
    for change in summary.mlp:
        layer, row = change.layer, scores[change.layer]
        if layer not in moe_layers(model):
            continue
        width = WIDTH
        per_expert = [[c % width for c in change.removed if c // width == e] for e in range(EXPERTS)]
        count = len(per_expert[0])
        assert count and all(len(p) == count for p in per_expert)
        for e, removed in enumerate(per_expert):
            own = row[e * width : (e + 1) * width]
            assert sorted(removed) == sorted(sorted(range(width), key=own.__getitem__)[:count])
        assert adapter.expert_width(layer) == WIDTH - count and (WIDTH - count) % 8 == 0
    assert logits(model).isfinite().all()


def test_magnitude_scores_one_float_per_item_and_other_criteria_refuse_moe_layers():
    model = fresh("qwen2_moe")
    scores = sinv_prune.get_criterion("magnitude", unit="mlp").compute(model)
    assert [len(r) for r in scores] == [EXPERTS * WIDTH + SHARED, DENSE, EXPERTS * WIDTH + SHARED]
    adapter = get_adapter(model)
    gate, up, down = adapter.expert_mlp(0, 2)
    expected = torch.cat([gate[5], up[5], down[:, 5]]).norm().item()
    assert scores[0][2 * WIDTH + 5] == pytest.approx(expected, rel=1e-5)
    random_scores = sinv_prune.get_criterion("random", unit="mlp").compute(model)
    assert [len(r) for r in random_scores] == [len(r) for r in scores]
    batches = [{"input_ids": INPUTS}]
    for name in ("activation", "taylor"):
        with pytest.raises(ValueError, match="layer 0 is a mixture-of-experts layer") as err:
            sinv_prune.get_criterion(name, unit="mlp").compute(model, batches)
        assert "\n" not in str(err.value)


def test_info_shows_per_layer_expert_widths(tmp_path):
    model = fresh("qwen2_moe")
    plan = expert_channel_plan(model, 8, shared=4)
    plan[2] = expert_channel_plan(model, 16)[2]
    sinv_prune.prune(model, {"mlp": plan})
    model.save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "expert channels kept 24/32 per expert, shared 16/20" in result.output
    assert "expert channels kept 16/32 per expert, shared 20/20" in result.output
    card = get_unit("mlp").card_text(get_record(model.config))
    assert card == "16 to 24 of 32 channels kept per expert in the pruned MoE layers"


def test_uniform_channel_cut_exports_to_gguf_and_round_trips(tmp_path):
    pytest.importorskip("llama_cpp")
    from test_gguf_moe import export
    from test_gguf_moe import tiny_moe as gguf_moe

    model = gguf_moe("qwen3_moe")
    sinv_prune.prune(model, {"mlp": expert_channel_plan(model, 16)})
    assert get_adapter(model).expert_width(0) == 16 and get_record(model.config).stock_layout
    out = export(model, tmp_path, verify=True)
    assert out.verify.passed and out.verify.top1_agreement == 1.0, out.verify


def test_rounds_follow_the_channels_in_original_numbering(tmp_path):
    model = fresh("qwen2_moe")
    summary = sinv_prune.Pruner([sinv_prune.Part("mlp", "random", 0.5)], rounds=2).prune(model)
    adapter = get_adapter(model)
    assert summary.channels_removed > 0 and all(adapter.expert_width(i) % 8 == 0 for i in moe_layers(model))
    record = get_record(model.config)
    for layer in moe_layers(model):  # the record describes the model as it is
        expected = adapter.num_experts(layer) * adapter.expert_width(layer) + adapter.shared_width(layer)
        assert len(record.kept_moe_items(layer)) == expected
    expected = logits(model)
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(logits(sinv_prune.from_pretrained(tmp_path).eval()), expected, atol=1e-6, rtol=0)


def test_an_exact_amount_the_experts_cannot_split_is_refused():
    model = fresh("mixtral")
    state, config = {k: v.clone() for k, v in model.state_dict().items()}, model.config.to_dict()
    with pytest.raises(ValueError, match="every expert of a mixture-of-experts layer loses the same number"):
        sinv_prune.Pruner([sinv_prune.Part("mlp", "random", 50, exact=True)]).prune(model)
    assert same_state(model, state, config)
    summary = sinv_prune.Pruner([sinv_prune.Part("mlp", "random", 50)]).prune(model)  # the nearest below
    assert summary.channels_removed == 48  # 8 from each of the 6 experts in one layer
