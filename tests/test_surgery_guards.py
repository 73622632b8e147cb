"""Surgery edge cases: the KV cache of an emptied layer under every argument name transformers
has used, refusal of quantized and offloaded models, and rollback of a call that fails part-way.
"""

from __future__ import annotations

import copy
import inspect

import accelerate
import pytest
import torch
import transformers
from conftest import ARCHS, model_output, tiny_model
from test_surgery import close, fresh, layouts, masked, padded_inputs

import sinv_prune
import sinv_prune.surgery.record
from sinv_prune.arch import get_adapter

# ``cache`` (transformers 5.24), ``past_key_values`` (5.0 to 5.23), ``past_key_value`` and ``layer_past`` (4.x).
CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


def emptied(arch: str, layer: int = 0):
    """A fresh tiny model whose ``layer`` lost every head."""
    model = fresh(arch)
    sinv_prune.prune_heads(model, {layer: list(range(layouts(model)[layer].num_heads))}, allow_empty_layers=True)
    return model


# -- the KV cache of an empty layer ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
@pytest.mark.parametrize("how", [*CACHE_NAMES, "positional"])
def test_empty_forward_advances_the_cache_however_it_is_passed(arch, how):
    model = emptied(arch)
    attn = get_adapter(model).attention(0)
    cache = transformers.DynamicCache()
    if how == "positional":  # where the stock forward's signature puts it
        names = list(inspect.signature(type(attn).forward).parameters)[2:]  # after self, hidden_states
        position = next(i for i, n in enumerate(names) if n in CACHE_NAMES)
        call = lambda h: attn(h, *[None] * position, cache)  # noqa: E731
    else:
        call = lambda h: attn(h, **{how: cache})  # noqa: E731
    hidden = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        call(hidden)
        assert cache.get_seq_length(0) == 5
        call(hidden[:, :1])
    assert cache.get_seq_length(0) == 6


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", CACHE_NAMES)
def test_generate_when_the_cache_comes_under_another_name(arch, name):
    """generate() with a KV cache matches the masked reference when layer 0, the layer generate()
    asks for the cached length, is empty and receives its cache as a transformers version would."""
    model = fresh(arch)
    request = {0: list(range(layouts(model)[0].num_heads))}
    ref = masked(model, arch, request)
    sinv_prune.prune_heads(model, request, allow_empty_layers=True)
    attn = get_adapter(model).attention(0)
    empty_forward = attn.forward

    def renamed(hidden_states, *args, **kwargs):  # hands on the cache under ``name``, whatever the caller used
        cache = next((kwargs.pop(n) for n in CACHE_NAMES if n in kwargs), None)
        return empty_forward(hidden_states, *args, **kwargs, **{name: cache})

    attn.forward = renamed
    inputs = padded_inputs(seed=1)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        got = model.generate(**inputs, **kwargs, use_cache=True)
        want = ref.generate(**inputs, **kwargs, use_cache=True)
        uncached = model.generate(**inputs, **kwargs, use_cache=False)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.sequences, uncached.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        close(a, b)


# -- quantized and offloaded models ----------------------------------------------------------------


def structure(model) -> tuple:
    """What prune_heads could change, without reading values (meta tensors have none)."""
    params = {k: (v, v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    return params, copy.deepcopy(model.config.to_dict()), type(model)


def assert_same_structure(model, before) -> None:
    params, config, cls = before
    now = model.state_dict(keep_vars=True)
    assert now.keys() == params.keys()
    for k, (tensor, shape) in params.items():
        assert now[k] is tensor and now[k].shape == shape, k
    assert model.config.to_dict() == config
    assert type(model) is cls


def _refused(model, match: str, request: dict | None = None) -> None:
    before = structure(model)
    with pytest.raises(ValueError, match=match) as err:
        sinv_prune.prune_heads(model, request or {0: [0, 1, 2]})
    assert "\n" not in str(err.value)
    assert_same_structure(model, before)


def test_model_built_under_init_empty_weights_is_refused():
    config = tiny_model("llama").config
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    _refused(model, r"cannot prune this model: model\.embed_tokens\.weight is on the meta device")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_model_with_an_offloaded_layer_is_refused(arch):
    model = fresh(arch)
    get_adapter(model).layers()[2].to("meta")  # what accelerate's offload leaves behind
    layer0 = {k: v.clone() for k, v in get_adapter(model).layers()[0].state_dict().items()}
    _refused(model, r"\.2\..* is on the meta device", {0: list(range(layouts(model)[0].group_size))})
    assert all(torch.equal(v, get_adapter(model).layers()[0].state_dict()[k]) for k, v in layer0.items())


class FakeParams4bit(torch.nn.Parameter):
    """Stands in for bitsandbytes' ``Params4bit`` (not installed): a Parameter subclass."""


def _fake_quantizer(model) -> None:
    model.hf_quantizer = object()


def _fake_quantization_config(model) -> None:
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}


def _int8_weight(model) -> None:
    proj = model.model.layers[1].self_attn.k_proj
    proj.weight = torch.nn.Parameter(torch.zeros(proj.weight.shape, dtype=torch.int8), requires_grad=False)


def _params4bit_weight(model) -> None:
    proj = model.model.layers[2].self_attn.o_proj
    proj.weight = FakeParams4bit(proj.weight.detach().clone())


@pytest.mark.parametrize(
    "make_quantized, match",
    [
        (_fake_quantizer, r"quantized \(object\)"),
        (_fake_quantization_config, r"quantized \(bitsandbytes\)"),
        (_int8_weight, r"layer 1: k_proj\.weight is a Parameter of dtype int8"),
        (_params4bit_weight, r"layer 2: o_proj\.weight is a FakeParams4bit of dtype float32"),
    ],
)
def test_quantized_model_is_refused(make_quantized, match):
    model = fresh("llama")
    make_quantized(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _refused(model, match)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


# -- rollback of a failure part-way ----------------------------------------------------------------


def _fail_on_second_slice(monkeypatch, model) -> None:
    cls = type(get_adapter(model))
    original, calls = cls.slice_heads, []

    def slice_heads(self, layer, keep_q, keep_kv):
        calls.append(layer)
        original(self, layer, keep_q, keep_kv)  # the second layer is half-done when the error comes
        if len(calls) == 2:
            raise RuntimeError("injected failure")

    monkeypatch.setattr(cls, "slice_heads", slice_heads)


def _fail_on_record(monkeypatch, model) -> None:
    """Fails in finalize_checkpoint_format, after the class and head counts changed."""

    def set_record(config, record):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(sinv_prune.surgery.record, "set_record", set_record)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fail", [_fail_on_second_slice, _fail_on_record])
@pytest.mark.parametrize("pruned_before", [False, True])
def test_failure_part_way_leaves_the_model_unchanged(monkeypatch, arch, fail, pruned_before):
    model = fresh(arch)
    lay = layouts(model)[0]
    group = list(range(lay.group_size))  # the first KV group: a valid removal in every layer
    if pruned_before:
        sinv_prune.prune_heads(model, {1: group})
    inputs = padded_inputs()
    expected = model_output(model, inputs)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    config, cls = copy.deepcopy(model.config.to_dict()), type(model)
    empty = list(range(layouts(model)[0].num_heads))

    fail(monkeypatch, model)
    with pytest.raises(RuntimeError, match="injected failure"):
        sinv_prune.prune_heads(model, {0: empty, 1: group, 2: group}, allow_empty_layers=True)
    monkeypatch.undo()

    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert type(model) is cls and model.config.to_dict() == config
    assert "forward" not in vars(get_adapter(model).attention(0))
    assert torch.equal(model_output(model, inputs), expected)
    if not pruned_before:  # the restored model prunes as if nothing had happened
        ref = masked(model, arch, {0: group, 2: group})
        sinv_prune.prune_heads(model, {0: group, 2: group})
        close(model_output(model, inputs), model_output(ref, inputs))


def test_the_remote_code_route_warning_comes_once_per_model(caplog):
    """Uneven cuts of a LLaMA model keep to remote code; saying so at every prune of it is noise."""
    from conftest import tiny_model

    import sinv_prune

    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=6)
    with caplog.at_level("WARNING", logger="sinv_prune"):
        sinv_prune.prune_heads(model, {0: [1]})
        sinv_prune.prune_heads(model, {1: [2]})
        sinv_prune.prune_heads(model, {0: [0]})
        other = tiny_model("llama", num_attention_heads=6, num_key_value_heads=6)
        sinv_prune.prune_heads(other, {2: [3]})
    warned = [r.getMessage() for r in caplog.records if "different head counts" in r.getMessage()]
    assert len(warned) == 2, warned  # one per model
