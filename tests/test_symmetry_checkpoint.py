"""Symmetry-broken checkpoints reload with the same outputs through every route.

A model trained with b_Q / b_V is saved; each checkpoint is loaded in one fresh process
(``reload_worker.py``) through the stock class, ``trust_remote_code=True`` and
``sinv_prune.from_pretrained``; every route must give the saved model's evaluation outputs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from conftest import VOCAB, model_inputs, model_output, reload_in_fresh_process, tiny_model

import sinv_prune
from sinv_prune.symmetry import add_symmetry_breaking, get_symmetry_breaking

HEAD_AUTO = {
    "gpt2": "AutoModelForCausalLM",
    "llama": "AutoModelForCausalLM",
    "qwen2": "AutoModelForCausalLM",
    "qwen3": "AutoModelForCausalLM",
    "bert": "AutoModelForMaskedLM",
    "roberta": "AutoModelForSequenceClassification",
}
UNEVEN = {"llama": {0: [0, 3], 2: [0, 1, 2]}, "qwen2": {0: [0, 2, 4], 2: [0, 1]}}  # GQA 3x2, 2x3
UNIFORM = {"llama": [0, 3], "qwen2": [0, 2, 4]}  # one query head per KV group
B_Q = {"mean": [0.1 * i - 0.3 for i in range(8)], "std": 0.2}
B_V = {"mean": 0.4, "std": 0.1}


def qwen3_model() -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


def _cases():
    """(name, arch, build, heads to remove or None, b_q): unpruned, uneven (remote code) and uniform cuts."""
    for arch in ("gpt2", "bert", "roberta", "llama", "qwen2"):
        yield f"{arch}-plain", arch, lambda arch=arch: tiny_model(arch), None, B_Q
        yield f"{arch}-uneven", arch, lambda arch=arch: tiny_model(arch), UNEVEN.get(arch, {0: [1], 2: [0, 3]}), B_Q
    for arch in ("llama", "qwen2"):
        heads = {layer: UNIFORM[arch] for layer in range(3)}  # stock route
        yield f"{arch}-uniform", arch, lambda arch=arch: tiny_model(arch), heads, B_Q
    yield "qwen3-v-only", "qwen3", qwen3_model, None, None


def _stock_route(name: str) -> bool:
    return name.endswith(("-plain", "-uniform", "-v-only"))


def _routes(name: str, arch: str) -> list[str]:
    routes = ["sinv"]
    if _stock_route(name):
        routes += ["stock", f"plain:{HEAD_AUTO[arch]}"]
    else:
        routes += [f"auto:{HEAD_AUTO[arch]}"]
    return routes


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """Train-time state: pruned, symmetry-broken models, saved; one worker reloads them all."""
    root = tmp_path_factory.mktemp("symmetry-reload")
    inputs = model_inputs(seed=4)
    saved, jobs = {}, {}
    for name, arch, build, heads, b_q in _cases():
        model = build()
        if heads:
            sinv_prune.prune_heads(model, heads)
        add_symmetry_breaking(model, b_q=b_q, b_v=B_V, seed=1)
        directory = root / name
        model.save_pretrained(directory)
        saved[name] = (model, directory, model_output(model, inputs))
        jobs[name] = (directory, _routes(name, arch))
    return saved, reload_in_fresh_process(root, inputs, jobs)


CASES = [(name, arch, route) for name, arch, _, _, _ in _cases() for route in _routes(name, arch)]


@pytest.mark.parametrize(("name", "arch", "route"), CASES, ids=[f"{n}-{r}" for n, _, r in CASES])
def test_every_route_gives_the_saved_outputs(reloaded, name, arch, route):
    saved, results = reloaded
    model, directory, expected = saved[name]
    got = results[name, route]
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    torch.testing.assert_close(got["main"], expected, rtol=1e-5, atol=1e-5)
    plain = copy.deepcopy(model)
    get_symmetry_breaking(plain).remove()
    assert not torch.allclose(model_output(plain, model_inputs(seed=4)), expected, atol=1e-3)  # the biases matter
    config = json.loads((directory / "config.json").read_text())
    assert config["sinv_symmetry"]["folded"] is True


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "qwen2"])
def test_sinv_reload_unfolds_to_the_trained_state(arch, tmp_path):
    """sinv_prune.from_pretrained gives back the same parameters, hooks and training-mode draws."""
    model = tiny_model(arch)
    sinv_prune.prune_heads(model, {1: UNIFORM.get(arch, [0, 3])})
    add_symmetry_breaking(model, b_q=B_Q, b_v=B_V, seed=2)
    model.save_pretrained(tmp_path)
    loaded = sinv_prune.from_pretrained(tmp_path, attn_implementation="eager")
    assert get_symmetry_breaking(loaded) is not None
    params = dict(model.named_parameters())
    assert set(dict(loaded.named_parameters())) == set(params)  # LLaMA: the biases folding added are gone again
    for n, p in loaded.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=0, atol=1e-6)
    assert loaded.config.attention_bias == model.config.attention_bias if arch == "llama" else True
    inputs = model_inputs()
    torch.testing.assert_close(model_output(loaded, inputs), model_output(model, inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_state_dict_round_trips_and_folds_for_hookless_models(arch):
    model = tiny_model(arch)
    add_symmetry_breaking(model, b_q=B_Q, b_v=B_V)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = model.state_dict()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])  # folded into copies, never in place
    q_bias = "transformer.h.0.attn.c_attn.bias" if arch == "gpt2" else "model.layers.0.self_attn.q_proj.bias"
    assert not torch.allclose(state[q_bias], before.get(q_bias, torch.zeros_like(state[q_bias])))
    model.load_state_dict(state)  # unfolds again: parameters unchanged
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=1e-6)
    plain = tiny_model(arch, attention_bias=True) if arch == "llama" else tiny_model(arch)
    plain.load_state_dict(state)
    torch.testing.assert_close(model_output(plain, model_inputs()), model_output(model, model_inputs()))


def test_unfoldable_architectures_are_refused_before_any_change():
    model = tiny_model("mistral")
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match="mistral: q_proj, v_proj have no bias and MistralConfig has no attention"):
        add_symmetry_breaking(model)
    assert set(model.state_dict()) == keys and not hasattr(model.config, "sinv_symmetry")
    qwen3 = qwen3_model()
    with pytest.raises(ValueError, match="after the per-head q_norm.*use b_q=None"):
        add_symmetry_breaking(qwen3)
    assert get_symmetry_breaking(qwen3) is None and not [n for n, _ in qwen3.named_buffers() if "sinv_b" in n]


def test_remove_restores_the_config():
    model = tiny_model("llama")
    assert model.config.attention_bias is False
    handle = add_symmetry_breaking(model)
    assert model.config.attention_bias is True and model.config.sinv_symmetry["attention_bias_added"] is True
    handle.remove()
    assert model.config.attention_bias is False and set(model.state_dict()) == set(tiny_model("llama").state_dict())


def test_checkpoints_written_before_folding_are_not_unfolded(tmp_path):
    """An old checkpoint (no "folded" flag) holds plain biases: loading it must not subtract E[b]."""
    model = tiny_model("gpt2")
    handle = add_symmetry_breaking(model, b_q=B_Q, b_v=B_V)
    expected = model_output(model, model_inputs())
    handle.remove()
    model.save_pretrained(tmp_path)  # plain biases, like the checkpoints of earlier versions
    config = json.loads((tmp_path / "config.json").read_text())
    legacy = {k: v for k, v in handle.setting.to_json().items() if k not in ("folded", "attention_bias_added")}
    (tmp_path / "config.json").write_text(json.dumps({**config, "sinv_symmetry": legacy}))
    loaded = sinv_prune.from_pretrained(tmp_path, attn_implementation="eager")
    torch.testing.assert_close(model_output(loaded, model_inputs()), expected, rtol=1e-5, atol=1e-5)
