"""``prune(model, plan)``: heads, MLP channels and whole blocks, on tiny models of every architecture.

The reference for a pruned model is the unpruned model with the removed heads' output-projection
input columns zeroed, the removed channels' down-projection input columns zeroed and the removed
blocks bypassed (their forward returns the hidden states it gets; every supported block returns a
bare tensor in transformers 5.24). Greedy generation with the KV cache is checked against greedy
decoding of the reference without a cache (recomputing the whole sequence each step), which
bypassed blocks cannot disturb.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from conftest import ARCHS, CAUSAL, model_output, reload_in_fresh_process, smollm2_model, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_checkpoint import HEAD_AUTO
from test_compensation import calibration
from test_surgery import close, expected_param_drop, fresh, head_removals, layouts, masked, padded_inputs

import sinv_prune
import sinv_prune.surgery.removal
from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import linear_weight
from sinv_prune.surgery.checkpoint import PREFIX
from sinv_prune.surgery.record import get_record

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- reference and expected sizes -------------------------------------------------------------


def down_weight(model, layer: int) -> tuple[torch.Tensor, int]:
    """The down projection's weight and the dimension indexing its input channels."""
    module = get_adapter(model).mlp_out(layer)
    return module.weight, 0 if isinstance(module, transformers.pytorch_utils.Conv1D) else 1


def reference(model, arch: str, plan: dict):
    """The unpruned ``model`` with the plan's heads and channels zeroed and its blocks bypassed."""
    ref = masked(model, arch, plan.get("heads", {}))
    with torch.no_grad():
        for layer, channels in plan.get("mlp", {}).items():
            weight, dim = down_weight(ref, layer)
            weight.index_fill_(dim, torch.tensor(channels, dtype=torch.long), 0.0)
    blocks = get_adapter(ref).layers()
    for layer in plan.get("layers", []):
        blocks[layer].forward = lambda *args, **kwargs: args[0] if args else kwargs["hidden_states"]
    return ref


def expected_drop(model, arch: str, plan: dict) -> int:
    """Parameters the plan frees on the unpruned ``model``, counted from shapes."""
    adapter = get_adapter(model)
    total = expected_param_drop(model, arch, plan.get("heads", {}))
    for layer, channels in plan.get("mlp", {}).items():
        per_channel = sum(linear_weight(m).shape[1] + (m.bias is not None) for m in adapter.mlp_in(layer))
        per_channel += linear_weight(adapter.mlp_out(layer)).shape[0]
        total += len(channels) * per_channel
    for layer in plan.get("layers", []):
        total += sum(p.numel() for p in adapter.layers()[layer].parameters())
    return total


@st.composite
def plans(draw, model) -> dict:
    """A valid plan mixing heads, channels and blocks (current numbering), any part possibly empty."""
    adapter = get_adapter(model)
    n = adapter.num_layers
    dropped = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
    kept = [i for i in range(n) if i not in dropped]
    heads = draw(head_removals([adapter.layout(i) for i in kept], allow_empty=True))
    mlp = {}
    for layer in kept:
        if draw(st.booleans()):
            width = adapter.intermediate_size(layer)
            mlp[layer] = draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=width - 1, unique=True))
    plan = {"heads": {kept[i]: h for i, h in heads.items()}, "mlp": mlp, "layers": dropped}
    return {k: v for k, v in plan.items() if v}


def group(model) -> list[int]:
    """The query heads of layer 0's first KV group (one head without GQA): a valid head removal."""
    return list(range(layouts(model)[0].group_size))


def greedy_reference(ref, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    ids = input_ids
    with torch.no_grad():
        for _ in range(steps):
            nxt = ref(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def greedy_generate(model, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=steps,
            min_new_tokens=steps, do_sample=False, use_cache=True, pad_token_id=0,
        )  # fmt: skip


def sliding_qwen2():
    """Qwen2 whose first layer is full attention and the others sliding: ``layer_types`` must follow drops."""
    return fresh("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)


# -- equivalence with the reference -------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@SETTINGS
@given(data=st.data())
def test_plan_matches_reference(arch, data):
    model = fresh(arch)
    plan = data.draw(plans(model), label="plan")
    ref = reference(model, arch, plan)
    drop = expected_drop(model, arch, plan)
    before = sum(p.numel() for p in model.parameters())
    summary = sinv_prune.prune(model, plan, allow_empty_layers=True)
    inputs = padded_inputs()
    close(model_output(model, inputs), model_output(ref, inputs))
    assert summary.params_before - summary.params_after == drop
    assert before - sum(p.numel() for p in model.parameters()) == drop
    assert summary.layers_removed == len(plan.get("layers", []))
    assert summary.channels_removed == sum(map(len, plan.get("mlp", {}).values()))
    n = len(layouts(ref)) - len(plan.get("layers", []))
    assert get_adapter(model).num_layers == n and model.config.num_hidden_layers == n
    # every attention's KV-cache slot is its position
    for i, block in enumerate(get_adapter(model).layers()):
        assert {m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)} == {i}


@pytest.mark.parametrize("arch", [*CAUSAL, "qwen2-sliding"])
def test_generate_with_cache_after_layer_removal(arch):
    model = sliding_qwen2() if arch == "qwen2-sliding" else fresh(arch)
    arch = arch.removesuffix("-sliding")
    # the first block goes (the cache's length is read from slot 0), heads and channels elsewhere
    plan = {"layers": [0], "heads": {1: list(range(layouts(model)[1].group_size))}, "mlp": {2: [1, 5, 7]}}
    types = getattr(model.config, "layer_types", None)
    ref = reference(model, arch, plan)
    sinv_prune.prune(model, plan)
    if types is not None:
        assert model.config.layer_types == types[1:]
    ids = padded_inputs()["input_ids"][:, :6]
    got = greedy_generate(model, ids, 5)
    assert torch.equal(got, greedy_reference(ref, ids, 5))


def test_qwen2_sliding_layer_types_and_window_follow_the_drop():
    model = sliding_qwen2()
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ref = reference(model, "qwen2", {"layers": [1]})
    sinv_prune.prune(model, {"layers": [1]})
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert model.config.max_window_layers == 1
    long = {"input_ids": torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(1))}
    close(model_output(model, long), model_output(ref, long))
    sinv_prune.prune(model, {"layers": [0]})
    assert model.config.layer_types == ["sliding_attention"] and model.config.max_window_layers == 0


# -- validation and rollback ---------------------------------------------------------------------

REFUSALS = [
    ({"neurons": {0: [1]}}, "unknown plan keys"),
    ([("heads", {})], "plan must be a mapping"),
    ({"mlp": {5: [0]}}, "unknown layer 5"),
    ({"mlp": {0: [0, 0]}}, "duplicate channel indices"),
    ({"mlp": {0: [999]}}, "out of range"),
    ({"mlp": {0: 3}}, "must be a collection of indices"),
    ({"mlp": {0: list(range(48))}}, "removing all 48 channels"),
    ({"layers": [0, 1, 2]}, "removing all 3 layers"),
    ({"layers": [1, 1]}, "duplicate layer indices"),
    ({"layers": [3]}, "out of range"),
    ({"layers": 1}, "must be a collection of indices"),
    ({"layers": [1], "mlp": {1: [0]}}, "removed by the plan and also have MLP channels"),
    ({"layers": [2], "heads": {2: [0]}}, "removed by the plan and also have heads"),
    ({"heads": {0: [9]}}, "out of range"),
]


@pytest.mark.parametrize(("plan", "message"), REFUSALS, ids=[m for _, m in REFUSALS])
def test_invalid_plans_are_refused_before_anything_changes(plan, message):
    model = fresh("bert")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with pytest.raises(ValueError, match=message) as err:
        sinv_prune.prune(model, plan)
    assert "\n" not in str(err.value)
    assert model.config.to_dict() == config
    assert (
        all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        and model.state_dict().keys() == state.keys()
    )


def test_bias_compensation_of_channels_needs_a_down_projection_bias():
    model = fresh("llama")
    with pytest.raises(ValueError, match="MLP down-projection bias"):
        sinv_prune.prune(model, {"mlp": {0: [1]}}, compensate="bias", calibration=calibration(1), add_bias=True)


def test_gpt2_with_depth_scaled_attention_refuses_layer_removal():
    model = fresh("gpt2", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        sinv_prune.prune(model, {"layers": [0]})


def _fail_after_dropping(monkeypatch, model) -> None:
    original = sinv_prune.surgery.removal.drop_layers

    def drop_then_fail(*args):
        original(*args)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(sinv_prune.surgery.removal, "drop_layers", drop_then_fail)


def _fail_on_second_mlp(monkeypatch, model) -> None:
    cls, calls = type(get_adapter(model)), []
    original = cls.slice_mlp

    def slice_mlp(self, layer, keep):
        calls.append(layer)
        original(self, layer, keep)
        if len(calls) == 2:
            raise RuntimeError("injected failure")

    monkeypatch.setattr(cls, "slice_mlp", slice_mlp)


@pytest.mark.parametrize("fail", [_fail_after_dropping, _fail_on_second_mlp])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_failure_part_way_restores_everything(monkeypatch, arch, fail):
    model = sliding_qwen2() if arch == "qwen2" else fresh(arch)
    sinv_prune.prune(model, {"heads": {0: group(model)}, "mlp": {1: [2]}})  # pruned before: a record exists
    inputs = padded_inputs()
    expected = model_output(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config, cls = copy.deepcopy(model.config.to_dict()), type(model)
    blocks = get_adapter(model).layers()
    fail(monkeypatch, model)
    with pytest.raises(RuntimeError, match="injected failure"):
        sinv_prune.prune(model, {"layers": [0], "mlp": {1: [1], 2: [0, 3]}, "heads": {1: group(model)}})
    assert type(model) is cls and model.config.to_dict() == config
    assert get_adapter(model).layers() == blocks
    for i, block in enumerate(blocks):
        assert {m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)} == {i}
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in now)
    close(model_output(model, inputs), expected, atol=0)


# -- record, composition and reload ------------------------------------------------------------


def _reload(directory):
    return sinv_prune.from_pretrained(directory, attn_implementation="eager")


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "qwen2"])
def test_prune_save_reload_prune_again_composes_in_original_numbering(arch, tmp_path):
    original = sliding_qwen2() if arch == "qwen2" else fresh(arch)
    model = copy.deepcopy(original)
    width = get_adapter(model).intermediate_size(0)
    heads = group(model)
    sinv_prune.prune(model, {"heads": {2: heads}, "mlp": {0: [0, 2], 2: [5]}, "layers": [1]})
    model.save_pretrained(tmp_path / "a")
    loaded = _reload(tmp_path / "a")
    inputs = padded_inputs()
    close(model_output(loaded, inputs), model_output(model, inputs), atol=1e-6)

    # current layers are original [0, 2]; current channel 3 of layer 1 is original channel 3 of layer 2 (5 gone)
    # and current channel 5 there is original 6.
    sinv_prune.prune(loaded, {"mlp": {1: [3, 5]}, "layers": [0]})
    record = get_record(loaded.config)
    assert record.removed_layers == [0, 1] and record.num_layers == 3
    assert record.pruned_mlp == {0: [0, 2], 2: [3, 5, 6]} and record.intermediate_size == width
    assert record.pruned_heads == {2: heads}
    union = {"heads": {2: heads}, "mlp": {2: [3, 5, 6]}, "layers": [0, 1]}
    close(model_output(loaded, inputs), model_output(reference(original, arch, union), inputs))

    loaded.save_pretrained(tmp_path / "b")
    again = _reload(tmp_path / "b")
    close(model_output(again, inputs), model_output(loaded, inputs), atol=1e-6)
    assert get_record(again.config) == record


def test_records_from_before_mlp_pruning_still_load(tmp_path):
    model = fresh("gpt2")
    sinv_prune.prune_heads(model, {0: [1]})
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("intermediate_size", "pruned_mlp", "removed_layers"):
        del saved["sinv_prune"][key]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = _reload(tmp_path)
    close(model_output(loaded, padded_inputs()), model_output(model, padded_inputs()), atol=1e-6)
    sinv_prune.prune(loaded, {"mlp": {1: [0]}, "layers": [2]})
    record = get_record(loaded.config)
    assert record.intermediate_size == 4 * model.config.n_embd and record.pruned_mlp == {1: [0]}


def _uniform_mlp_and_depth(model) -> dict:
    """Every kept layer loses the same number of channels (different ones), the last block goes."""
    return {"mlp": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, "layers": [2]}


def _mixed(model) -> dict:
    """Uneven: heads of one layer (a whole KV group under GQA), channels of another, the last block."""
    return {"heads": {1: list(range(layouts(model)[0].group_size))}, "mlp": {0: [1, 3]}, "layers": [2]}


def _reload_cases():
    out = []
    for arch in ARCHS:
        out.append((f"{arch}-mixed", arch, _mixed, ["sinv", f"auto:{HEAD_AUTO[arch]}", "auto:AutoModel"]))
        out.append((f"{arch}-uniform", arch, _uniform_mlp_and_depth, ["sinv", "stock", f"plain:{HEAD_AUTO[arch]}"]))
    return out


@pytest.fixture(scope="module")
def reloads(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-reload")
    inputs = padded_inputs(seed=3)
    expected, jobs = {}, {}
    for name, arch, make, routes in _reload_cases():
        model = fresh(arch)
        plan = make(model)
        ref = reference(model, arch, plan)
        sinv_prune.prune(model, plan, allow_empty_layers=True)
        close(model_output(model, inputs), model_output(ref, inputs))
        model.save_pretrained(root / name)
        with torch.no_grad():
            expected[name] = (type(model), model_output(model, inputs), model.base_model(**inputs).last_hidden_state)
        jobs[name] = (root / name, routes)
    return root, expected, reload_in_fresh_process(root, inputs, jobs)


RELOAD_CASES = [(name, arch, route) for name, arch, _, routes in _reload_cases() for route in routes]


@pytest.mark.parametrize(("name", "arch", "route"), RELOAD_CASES, ids=[f"{n}-{r}" for n, _, r in RELOAD_CASES])
def test_fresh_process_reload_through_every_route(reloads, name, arch, route):
    root, expected, results = reloads
    cls, head_out, base_out = expected[name]
    got = results[name, route]
    want = base_out if route == "auto:AutoModel" else head_out
    close(got["main"], want, atol=1e-6)
    assert got["mismatched"] == []
    if route != "auto:AutoModel":
        assert got["missing"] == [] and got["unexpected"] == []
    saved = json.loads((root / name / "config.json").read_text())
    base_name = cls.__name__.removeprefix(PREFIX)
    if name.endswith("-uniform"):
        assert "auto_map" not in saved and saved["architectures"] == [base_name]
        assert saved["sinv_prune"]["stock_layout"] is True and saved["sinv_prune"]["removed_layers"] == [2]
        assert not got["class"].startswith(PREFIX)
        if route != "sinv":
            assert got["sinv_prune_loaded"] is False and got["module"].startswith("transformers.models.")
    else:
        assert saved["sinv_prune"]["stock_layout"] is False and got["class"].startswith(PREFIX)
        assert (root / name / "modeling_sinv_prune.py").exists()


def test_uniform_llama_heads_mlp_and_depth_take_the_stock_route(tmp_path):
    model = fresh("llama")
    plan = {"heads": {0: [0, 3], 1: [1, 4]}, "mlp": {0: [0, 1], 1: [2, 3]}, "layers": [2]}
    ref = reference(model, "llama", plan)
    sinv_prune.prune(model, plan)
    assert type(model) is transformers.LlamaForCausalLM
    c = model.config
    assert (c.num_attention_heads, c.intermediate_size, c.num_hidden_layers) == (4, 62, 2)
    model.save_pretrained(tmp_path)
    stock = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    close(model_output(stock, padded_inputs()), model_output(ref, padded_inputs()))


def test_summary_reports_heads_channels_and_layers():
    model = fresh("llama")
    sinv_prune.prune(model, {"layers": [0]})
    summary = sinv_prune.prune(model, {"heads": {0: [0, 1, 2]}, "mlp": {0: [4, 2]}, "layers": [1]})
    data = summary.to_dict()
    assert data["heads_removed"] == 3 and data["channels_removed"] == 2 and data["layers_removed"] == 1
    assert data["mlp"] == [{"layer": 0, "removed": [2, 4], "removed_original": [2, 4], "kept": 62}]
    assert data["removed_layers"] == [1] and data["removed_layers_original"] == [2]
    text = str(summary)
    assert "layers removed: [1] (original numbering [2])" in text and "parameters:" in text


# -- compensation of channels ---------------------------------------------------------------------


def _down_error(model, pruned, batches, layer: int) -> float:
    """Relative error of the pruned model's down-projection output against the unpruned one, on ``batches``."""
    outs = []
    for m in (model, pruned):
        seen = []
        handle = get_adapter(m).mlp_out(layer).register_forward_hook(lambda mod, a, o, seen=seen: seen.append(o))
        for b in batches:
            model_output(m, b)
        handle.remove()
        outs.append(torch.cat([o.reshape(-1, o.shape[-1]) for o in seen]))
    return ((outs[1] - outs[0]).norm() / outs[0].norm()).item()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lsq_compensation_reduces_the_mlp_error(arch):
    model = tiny_model(arch)
    plan = {"mlp": {0: list(range(0, 40, 2)), 1: list(range(1, 40, 3))}, "layers": [2]}
    batches = calibration(4)
    plain, fitted = copy.deepcopy(model), copy.deepcopy(model)
    sinv_prune.prune(plain, plan)
    summary = sinv_prune.prune(fitted, plan, calibration=batches, compensate="lsq", ridge=0.01)
    assert [(f.layer, f.unit) for f in summary.compensation.layers] == [(0, "mlp"), (1, "mlp")]
    assert all(f.error_after < f.error_before for f in summary.compensation.layers)
    held_out = calibration(2, seed=7)
    for layer in (0, 1):
        assert _down_error(model, fitted, held_out, layer) < _down_error(model, plain, held_out, layer)


def test_bias_compensation_of_channels_adds_the_mean_contribution():
    model = tiny_model("gpt2")
    batches = calibration(2)
    fitted = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    sinv_prune.prune(plain, {"mlp": {0: [0, 5, 9]}})
    summary = sinv_prune.prune(fitted, {"mlp": {0: [0, 5, 9]}}, calibration=batches, compensate="bias")
    (fit,) = summary.compensation.layers
    assert fit.unit == "mlp" and fit.error_after < fit.error_before
    # only the bias moved
    assert torch.equal(fitted.transformer.h[0].mlp.c_proj.weight, plain.transformer.h[0].mlp.c_proj.weight)
    assert not torch.equal(fitted.transformer.h[0].mlp.c_proj.bias, plain.transformer.h[0].mlp.c_proj.bias)


# -- real weights -----------------------------------------------------------------------------------


@pytest.mark.real
def test_smollm2_mixed_plan_and_stock_reload_of_a_uniform_cut(tmp_path):
    model = smollm2_model(attn_implementation="eager")
    inputs = {"input_ids": torch.tensor([[1, 504, 3458, 314, 253, 1345, 30]])}
    width, n = model.config.intermediate_size, model.config.num_hidden_layers
    # 30 layers of float32 sums in another order: logits (up to ~20) agree to ~1e-4
    tol = {"atol": 1e-3, "rtol": 1e-4}

    uniform = {"mlp": {layer: list(range(layer % 4, width, 4)) for layer in range(n) if layer not in (7, 8)}}
    uniform["layers"] = [7, 8]
    want = model_output(reference(model, "llama", uniform), inputs)
    pruned = copy.deepcopy(model)
    sinv_prune.prune(pruned, uniform)
    got = model_output(pruned, inputs)
    torch.testing.assert_close(got, want, **tol)
    pruned.save_pretrained(tmp_path)
    del pruned
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" not in saved and saved["sinv_prune"]["stock_layout"] is True
    assert saved["intermediate_size"] == width - width // 4 and saved["num_hidden_layers"] == n - 2
    stock = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    close(model_output(stock, inputs), got, atol=1e-5)
    del stock

    mixed = {"heads": {3: [0, 1, 2]}, "mlp": {5: list(range(0, width, 3))}, "layers": [10, 20]}
    want = model_output(reference(model, "llama", mixed), inputs)
    sinv_prune.prune(model, mixed)
    torch.testing.assert_close(model_output(model, inputs), want, **tol)


@pytest.mark.real
def test_minilm_mixed_plan_matches_the_reference():
    from conftest import minilm_dir

    model = transformers.AutoModel.from_pretrained(minilm_dir(), attn_implementation="eager").eval()
    inputs = {"input_ids": torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102]])}
    plan = {"heads": {0: [1, 4], 2: [0]}, "mlp": {1: list(range(0, 1536, 2)), 5: [3, 7]}, "layers": [3]}
    ref = reference(model, "bert", plan)
    sinv_prune.prune(model, plan)
    close(model_output(model, inputs), model_output(ref, inputs), atol=1e-4)


def test_cli_info_and_model_card_name_removed_blocks_and_channels(tmp_path):
    from click.testing import CliRunner

    from sinv_prune.cli import main
    from sinv_prune.hub.model_card import model_card

    model = fresh("gpt2")
    sinv_prune.prune(model, {"heads": {0: [1]}, "mlp": {0: [0, 1, 2]}, "layers": [1]})
    model.save_pretrained(tmp_path)
    info = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert info.exit_code == 0, info.output
    assert "layer   1: removed (the whole block)" in info.output
    assert "removed [1]  MLP channels kept 125/128" in info.output
    card = model_card(model.config, repo_id="me/tiny")
    assert "1 whole blocks removed (original layers [1]); 125 to 128 of 128 MLP channels kept" in card


@pytest.mark.parametrize("drop", [[0], [1], [0, 2]])
def test_dropped_blocks_keep_max_window_layers_stating_the_full_attention_layers(drop):
    """Qwen2's ``max_window_layers`` counts the full-attention layers below the sliding ones (its ``layer_types``
    follow from it): after a drop it counts the kept ones, so the two still agree."""
    model = fresh("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    types = list(model.config.layer_types)
    sinv_prune.prune(model, {"layers": drop})
    kept = [t for i, t in enumerate(types) if i not in drop]
    assert model.config.layer_types == kept
    window = model.config.max_window_layers
    assert kept == ["full_attention" if j < window else "sliding_attention" for j in range(len(kept))]
