"""Checkpoints of pruned models: composition across save/reload, every reload route, the stock fallback.

The fresh-process checks run one worker process (``reload_worker.py``) for the whole
module: it loads every checkpoint through every route and writes the outputs,
which the tests compare with the in-memory pruned models.
"""

from __future__ import annotations

import json
import logging
import tempfile

import pytest
import torch
import transformers
from conftest import ARCHS, model_output, reload_in_fresh_process, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_surgery import LLAMA_FAMILY, close, fresh, head_removals, layouts, masked, padded_inputs

import sinv_prune
from sinv_prune.surgery.checkpoint import PREFIX

HEAD_AUTO = {
    "gpt2": "AutoModelForCausalLM",
    "llama": "AutoModelForCausalLM",
    "qwen2": "AutoModelForCausalLM",
    "mistral": "AutoModelForCausalLM",
    "bert": "AutoModelForMaskedLM",
    "roberta": "AutoModelForSequenceClassification",
}
assert set(HEAD_AUTO) == set(ARCHS)


def reload(directory) -> transformers.PreTrainedModel:
    return sinv_prune.from_pretrained(directory, attn_implementation="eager")


# -- composition: prune, save, reload, prune again in the new numbering -------------------------


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_prune_save_reload_prune_again(arch, data):
    model = fresh(arch)
    original = fresh(arch)
    first = data.draw(head_removals(layouts(model), allow_empty=True), label="first")
    sinv_prune.prune_heads(model, first, allow_empty_layers=True)
    inputs = padded_inputs()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        loaded = reload(tmp)
    assert type(loaded) is type(model)
    assert layouts(loaded) == layouts(model)
    close(model_output(loaded, inputs), model_output(model, inputs), atol=1e-6)

    second = data.draw(head_removals(layouts(loaded), allow_empty=True), label="second")
    sinv_prune.prune_heads(loaded, second, allow_empty_layers=True)

    # The union in original numbering: the second request's indices count the heads still there.
    union = {}
    for layer in range(len(layouts(original))):
        kept = [h for h in range(layouts(original)[layer].num_heads) if h not in first.get(layer, ())]
        removed = set(first.get(layer, ())) | {kept[h] for h in second.get(layer, ())}
        if removed:
            union[layer] = sorted(removed)
    close(model_output(loaded, inputs), model_output(masked(original, arch, union), inputs))
    assert getattr(loaded.config, "sinv_prune", {}).get("pruned_heads", {}) == {str(k): v for k, v in union.items()}

    with tempfile.TemporaryDirectory() as tmp:
        loaded.save_pretrained(tmp)
        again = reload(tmp)
    close(model_output(again, inputs), model_output(loaded, inputs), atol=1e-6)
    assert getattr(again.config, "sinv_prune", {}).get("pruned_heads", {}) == {str(k): v for k, v in union.items()}


# -- stock route and its fallback ---------------------------------------------------------------

UNIFORM = {  # the same kept head count in every layer, different heads per layer
    "llama": {0: [0, 3], 1: [1, 4], 2: [2, 5]},  # 6 heads / 2 KV -> 4 heads / 2 KV
    "qwen2": {0: [0, 1], 1: [2, 3], 2: [4, 5]},  # 6 heads / 3 KV -> 4 heads / 2 KV
    "mistral": {0: [0, 2], 1: [1, 3], 2: [0, 3]},  # 4 heads / 2 KV -> 2 heads / 2 KV
}


def _fallback_model():
    """A LLaMA whose config refuses 5 heads with hidden size 48 (no GQA here, so any count is valid)."""
    return tiny_model("llama", num_key_value_heads=6)


def test_installed_llama_config_refuses_indivisible_head_counts():
    """The premise of the fallback test: LlamaConfig checks hidden_size % heads even with head_dim given."""
    transformers.LlamaConfig(hidden_size=48, num_attention_heads=6, head_dim=8)
    with pytest.raises(Exception, match="not a multiple"):
        transformers.LlamaConfig(hidden_size=48, num_attention_heads=5, head_dim=8)


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_uniform_llama_family_takes_the_stock_route(arch, tmp_path, caplog):
    model = fresh(arch)
    base = type(model)
    with caplog.at_level(logging.WARNING):
        sinv_prune.prune_heads(model, UNIFORM[arch])
    assert not [r for r in caplog.records if r.name.startswith("sinv_prune")]
    (lay,) = set(layouts(model))
    assert type(model) is base
    assert model.config.num_attention_heads == lay.num_heads
    assert model.config.num_key_value_heads == lay.num_kv_heads
    assert model.config.sinv_prune["stock_layout"] is True
    assert not getattr(model.config, "auto_map", None)

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" not in saved and saved["architectures"] == [base.__name__]
    assert not (tmp_path / "modeling_sinv_prune.py").exists()
    stock = base.from_pretrained(tmp_path, attn_implementation="eager")
    close(model_output(stock, padded_inputs()), model_output(model, padded_inputs()), atol=1e-6)

    # Pruning one layer further breaks the uniformity: back to the remote-code route, original sizes.
    sinv_prune.prune_heads(model, {0: list(range(lay.group_size))})
    assert type(model).__name__ == PREFIX + base.__name__
    assert model.config.num_attention_heads == fresh(arch).config.num_attention_heads
    assert model.config.sinv_prune["stock_layout"] is False
    assert model.config.auto_map["AutoModelForCausalLM"] == f"modeling_sinv_prune.{PREFIX}{base.__name__}"


def test_llama_fallback_to_remote_code_warns(tmp_path, caplog):
    model = _fallback_model()
    ref = masked(model, "llama", {0: [0], 1: [1], 2: [2]})
    with caplog.at_level(logging.WARNING):
        sinv_prune.prune_heads(model, {0: [0], 1: [1], 2: [2]})
    warnings = [r for r in caplog.records if r.name == "sinv_prune.surgery.checkpoint" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "LlamaConfig refuses 5 heads" in warnings[0].getMessage()
    assert "trust_remote_code=True" in warnings[0].getMessage()
    assert type(model).__name__ == PREFIX + "LlamaForCausalLM"
    assert model.config.num_attention_heads == 6 and model.config.sinv_prune["stock_layout"] is False
    close(model_output(model, padded_inputs()), model_output(ref, padded_inputs()))

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [PREFIX + "LlamaForCausalLM"]
    assert saved["auto_map"]["AutoModelForCausalLM"] == f"modeling_sinv_prune.{PREFIX}LlamaForCausalLM"
    assert (tmp_path / "modeling_sinv_prune.py").exists()
    close(model_output(reload(tmp_path), padded_inputs()), model_output(model, padded_inputs()), atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "bert", "roberta"])
def test_other_families_take_the_remote_code_route_silently(arch, caplog):
    model = fresh(arch)
    with caplog.at_level(logging.WARNING):
        sinv_prune.prune_heads(model, {0: [1], 1: [1], 2: [1]})  # uniform, still no stock class for it
    assert not [r for r in caplog.records if r.name.startswith("sinv_prune")]
    assert type(model).__name__.startswith(PREFIX)
    assert model.config.sinv_prune["stock_layout"] is False


# -- save -> reload in a fresh process, through every route ----------------------------------------


def _mixed_request(model) -> dict[int, list[int]]:
    """Different counts per layer: a KV group (and for MHA one more head) from layer 0, all of layer 1."""
    lay = layouts(model)[0]
    first = list(range(lay.group_size)) if lay.group_size > 1 else [0, 2]
    return {0: first, 1: list(range(lay.num_heads))}


def _checkpoints() -> list[tuple[str, str, object, dict]]:
    """(name, arch, builder, request) of every checkpoint the fresh process loads."""
    out = [(f"{arch}-mixed", arch, lambda arch=arch: fresh(arch), None) for arch in ARCHS]
    out += [(f"{arch}-uniform", arch, lambda arch=arch: fresh(arch), UNIFORM[arch]) for arch in LLAMA_FAMILY]
    out.append(("llama-fallback", "llama", _fallback_model, {0: [0], 1: [1], 2: [2]}))
    return out


def _routes(name: str, arch: str) -> list[str]:
    routes = ["sinv", f"auto:{HEAD_AUTO[arch]}", "auto:AutoModel"]
    if name.endswith("-uniform"):
        routes += ["stock", f"plain:{HEAD_AUTO[arch]}"]
    return routes


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """Save every checkpoint, run the worker once over all (checkpoint, route) jobs, return the results."""
    root = tmp_path_factory.mktemp("reload")
    inputs = padded_inputs(seed=3)
    checkpoints, jobs = {}, {}
    for name, arch, build, request in _checkpoints():
        model = build()
        ref = masked(model, arch, request or _mixed_request(model))
        sinv_prune.prune_heads(model, request or _mixed_request(model), allow_empty_layers=True)
        close(model_output(model, inputs), model_output(ref, inputs))
        directory = root / name
        model.save_pretrained(directory)
        with torch.no_grad():
            expected = {"head": model_output(model, inputs), "base": model.base_model(**inputs).last_hidden_state}
        checkpoints[name] = (model, directory, expected)
        jobs[name] = (directory, _routes(name, arch))
    return checkpoints, reload_in_fresh_process(root, inputs, jobs)


CASES = [(name, arch, route) for name, arch, _, _ in _checkpoints() for route in _routes(name, arch)]


@pytest.mark.parametrize(("name", "arch", "route"), CASES, ids=[f"{n}-{r}" for n, _, r in CASES])
def test_fresh_process_reload(fresh_process, name, arch, route):
    checkpoints, results = fresh_process
    model, directory, expected = checkpoints[name]
    got = results[name, route]
    base_name = type(model).__name__.removeprefix(PREFIX)

    want = expected["base"] if route == "auto:AutoModel" else expected["head"]
    assert got["main"].shape == want.shape
    close(got["main"], want, atol=1e-6)
    assert got["mismatched"] == []
    if route == "auto:AutoModel":
        assert not [k for k in got["missing"] if "attn" in k or "attention" in k], got["missing"]
    else:
        assert got["missing"] == [] and got["unexpected"] == []

    saved = json.loads((directory / "config.json").read_text())
    if name.endswith("-uniform"):
        # Stock route: the stock class, no remote code, sinv_prune never imported.
        assert "auto_map" not in saved and saved["architectures"] == [base_name]
        assert saved["num_attention_heads"] == layouts(model)[0].num_heads
        assert not got["class"].startswith(PREFIX)
        if route in ("stock", f"plain:{HEAD_AUTO[arch]}"):
            assert got["class"] == base_name
            assert got["module"].startswith("transformers.models.")
            assert got["sinv_prune_loaded"] is False
    else:
        assert saved["architectures"] == [PREFIX + base_name]
        assert set(saved["auto_map"]) >= {"AutoModel", HEAD_AUTO[arch]}
        assert saved["sinv_prune"]["stock_layout"] is False
        assert (directory / "modeling_sinv_prune.py").exists()
        assert got["class"].startswith(PREFIX)
        if route.startswith("auto:"):
            assert got["module"].startswith("transformers_modules"), got["module"]
            expected_class = PREFIX + (base_name if route != "auto:AutoModel" else type(model.base_model).__name__)
            assert got["class"] == expected_class
        else:
            assert got["class"] == PREFIX + base_name


def test_remote_code_of_0_1_0_checkpoints_still_resolves_its_classes():
    """Checkpoints saved by 0.1.0 ship a modeling file that imports ``sinv_prune.checkpoint.class_by_name``."""
    from sinv_prune.checkpoint import class_by_name

    cls = class_by_name("SinvPrunedGPT2LMHeadModel", "sinv_prune.modeling_sinv_prune")
    assert cls.__name__ == "SinvPrunedGPT2LMHeadModel" and cls._sinv_base is transformers.GPT2LMHeadModel
