"""Head surgery on tiny random models of every supported architecture.

The reference for a pruned model is an unpruned copy whose output projection
ignores the removed heads: their input columns (rows for GPT-2's ``Conv1D``) are
zeroed directly on the weight, independently of the adapters' slicing code.

The helpers at the top (strategy, masking, expected parameter counts) are shared
with ``test_gates.py`` and ``test_checkpoint.py``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers
from conftest import ARCHS, CAUSAL, model_inputs, model_output, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sinv_prune
from sinv_prune.arch import get_adapter

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
HYPOTHESIS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- shared helpers ----------------------------------------------------------------------------


def layouts(model) -> list:
    adapter = get_adapter(model)
    return [adapter.layout(i) for i in range(adapter.num_layers)]


@st.composite
def head_removals(draw, layouts, allow_empty: bool = False) -> dict[int, list[int]]:
    """A valid request for a model with these head layouts (current numbering).

    Per layer: either nothing, or a set of KV groups to keep (possibly none when
    ``allow_empty``) and the same number of query heads kept in each of them.
    """
    request = {}
    for layer, lay in enumerate(layouts):
        if lay.num_heads == 0 or not draw(st.booleans()):
            continue
        group = lay.group_size
        kv_kept = draw(st.sets(st.integers(0, lay.num_kv_heads - 1), min_size=0 if allow_empty else 1))
        per_group = draw(st.integers(1, group))
        kept = set()
        for kv in kv_kept:
            kept |= draw(st.sets(st.integers(kv * group, (kv + 1) * group - 1), min_size=per_group, max_size=per_group))
        removed = [h for h in range(lay.num_heads) if h not in kept]
        if removed:
            request[layer] = draw(st.permutations(removed))
    return request


def head_dim_of(model, arch: str) -> int:
    cfg = model.config
    if arch == "gpt2":
        return cfg.n_embd // cfg.n_head
    if arch in ("bert", "roberta"):
        return cfg.hidden_size // cfg.num_attention_heads
    return cfg.head_dim


def out_proj_weight(model, arch: str, layer: int) -> tuple[torch.Tensor, int]:
    """The output projection's weight and the dimension that indexes its inputs."""
    base = model.base_model
    if arch == "gpt2":
        return base.h[layer].attn.c_proj.weight, 0  # Conv1D: [in, out]
    if arch in ("bert", "roberta"):
        return base.encoder.layer[layer].attention.output.dense.weight, 1
    return base.layers[layer].self_attn.o_proj.weight, 1


def masked(model, arch: str, removed: dict[int, list[int]]):
    """A copy of the unpruned ``model`` whose output projection ignores the ``removed`` heads."""
    ref = copy.deepcopy(model)
    d = head_dim_of(ref, arch)
    with torch.no_grad():
        for layer, heads in removed.items():
            weight, dim = out_proj_weight(ref, arch, layer)
            for h in heads:
                weight.narrow(dim, h * d, d).zero_()
    return ref


def expected_param_drop(model, arch: str, removed: dict[int, list[int]]) -> int:
    """Parameters that removing ``removed`` (original numbering) from the unpruned ``model`` frees."""
    cfg = model.config
    d = head_dim_of(model, arch)
    total = 0
    for layer, heads in removed.items():
        r = len(set(heads))
        if arch == "gpt2":
            # c_attn: 3 weight column blocks [D, d] plus 3 bias blocks; c_proj: a [d, D] row block.
            total += r * (3 * d * cfg.n_embd + 3 * d + d * cfg.n_embd)
        elif arch in ("bert", "roberta"):
            # query/key/value: [d, D] + bias d each; output.dense: a [D, d] column block.
            total += r * (3 * (d * cfg.hidden_size + d) + cfg.hidden_size * d)
        else:
            attn = model.base_model.layers[layer].self_attn
            group = cfg.num_attention_heads // cfg.num_key_value_heads
            kv_gone = sum(
                1 for kv in range(cfg.num_key_value_heads) if set(range(kv * group, (kv + 1) * group)) <= set(heads)
            )
            q_bias = d if attn.q_proj.bias is not None else 0
            kv_bias = d if attn.k_proj.bias is not None else 0
            total += r * (2 * d * cfg.hidden_size + q_bias)  # q_proj rows and o_proj columns
            total += kv_gone * 2 * (d * cfg.hidden_size + kv_bias)  # k_proj and v_proj rows
    return total


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def snapshot(model) -> tuple:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, copy.deepcopy(model.config.to_dict()), type(model)


def assert_unchanged(model, snap) -> None:
    state, config, cls = snap
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert now[k].shape == v.shape, k
        assert torch.equal(now[k], v), k
    assert model.config.to_dict() == config
    assert type(model) is cls


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def padded_inputs(seed: int = 0) -> dict:
    """Two rows, the first left-padded by two positions."""
    inputs = model_inputs(seed)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :2] = 0
    return {**inputs, "attention_mask": mask}


_BASE: dict[tuple, transformers.PreTrainedModel] = {}


def fresh(arch: str, **kwargs):
    """A new copy of the cached tiny model of ``arch`` (building one costs more than copying)."""
    key = (arch, *sorted(kwargs.items()))
    if key not in _BASE:
        _BASE[key] = tiny_model(arch, **kwargs)
    return copy.deepcopy(_BASE[key])


# -- equivalence with the masked reference ----------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@HYPOTHESIS
@given(data=st.data())
def test_pruned_equals_masked_reference(arch, data):
    model = fresh(arch)
    request = data.draw(head_removals(layouts(model), allow_empty=data.draw(st.booleans())), label="request")
    allow_empty = any(len(h) == layouts(model)[layer].num_heads for layer, h in request.items())
    ref = masked(model, arch, request)
    before = num_params(model)

    summary = sinv_prune.prune_heads(model, request, allow_empty_layers=allow_empty)

    assert [c.layer for c in summary.layers] == sorted(request)
    for c in summary.layers:
        lay = layouts(ref)[c.layer]
        kept = [h for h in range(lay.num_heads) if h not in request[c.layer]]
        assert c.removed == c.removed_original == sorted(request[c.layer])
        assert (c.kept, c.kept_kv) == (len(kept), len({h // lay.group_size for h in kept}))
    inputs = padded_inputs()
    close(model_output(model, inputs), model_output(ref, inputs))
    assert num_params(model) == before - expected_param_drop(ref, arch, request)
    assert summary.params_before == before and summary.params_after == num_params(model)
    for layer, lay in enumerate(layouts(model)):
        assert lay.num_heads == layouts(ref)[layer].num_heads - len(request.get(layer, ()))
    recorded = getattr(model.config, "sinv_prune", {}).get("pruned_heads", {})  # no record when nothing went
    assert recorded == {str(k): sorted(v) for k, v in sorted(request.items())}


@pytest.mark.parametrize("arch", CAUSAL)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_generate_with_cache_matches_masked_reference(arch, data):
    model = fresh(arch)
    request = data.draw(head_removals(layouts(model), allow_empty=True), label="request")
    _check_generate(model, arch, request)


@pytest.mark.parametrize("arch", CAUSAL)
@pytest.mark.parametrize("empty_layer", [0, 1, 2])
def test_generate_with_an_empty_layer(arch, empty_layer):
    model = fresh(arch)
    lay = layouts(model)[0]
    other = 1 if empty_layer != 1 else 0
    # Every head of one layer, and the first KV group (one head without GQA) of another.
    request = {empty_layer: list(range(lay.num_heads)), other: list(range(lay.group_size))}
    _check_generate(model, arch, request)


def _check_generate(model, arch, request):
    ref = masked(model, arch, request)
    sinv_prune.prune_heads(model, request, allow_empty_layers=True)
    inputs = padded_inputs(seed=1)
    kwargs = dict(
        max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        got = model.generate(**inputs, **kwargs)
        want = ref.generate(**inputs, **kwargs)
    assert got.sequences.shape == (2, inputs["input_ids"].shape[1] + 6)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == 6
    for a, b in zip(got.logits, want.logits, strict=True):
        close(a, b)


def test_gqa_group_removal_drops_kv_heads():
    model = fresh("llama")  # 6 query heads, 2 KV heads: groups {0, 1, 2} and {3, 4, 5}
    ref = masked(model, "llama", {0: [0, 1, 2], 1: [1, 4]})
    sinv_prune.prune_heads(model, {0: [2, 0, 1], 1: [4, 1]})
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert (attn0.q_proj.out_features, attn0.k_proj.out_features, attn0.v_proj.out_features) == (24, 8, 8)
    assert attn0.o_proj.in_features == 24 and attn0.num_key_value_groups == 3
    assert (attn1.q_proj.out_features, attn1.k_proj.out_features, attn1.num_key_value_groups) == (32, 16, 2)
    # The kept K/V rows are the second KV head's, unchanged.
    ref_attn0 = ref.model.layers[0].self_attn
    assert torch.equal(attn0.k_proj.weight, ref_attn0.k_proj.weight[8:])
    assert torch.equal(attn0.v_proj.weight, ref_attn0.v_proj.weight[8:])
    inputs = padded_inputs()
    close(model_output(model, inputs), model_output(ref, inputs))


# -- the summary -----------------------------------------------------------------------------


def test_summary_reports_layers_and_parameters():
    model = fresh("llama")
    before = num_params(model)
    first = sinv_prune.prune_heads(model, {2: [5, 2], 0: [0, 1, 2]})
    assert [c.layer for c in first.layers] == [0, 2]
    c0, c2 = first.layers
    assert (c0.removed, c0.removed_original, c0.kept, c0.kept_kv) == ([0, 1, 2], [0, 1, 2], 3, 1)
    assert (c2.removed, c2.removed_original, c2.kept, c2.kept_kv) == ([2, 5], [2, 5], 4, 2)
    assert first.heads_removed == 5
    assert first.params_before == before
    assert first.params_after == before - expected_param_drop(fresh("llama"), "llama", {0: [0, 1, 2], 2: [2, 5]})

    # Second call: indices in the current numbering; the summary maps them back.
    second = sinv_prune.prune_heads(model, {2: [1, 3]}, allow_empty_layers=False)
    (c,) = second.layers
    assert (c.layer, c.removed, c.removed_original, c.kept, c.kept_kv) == (2, [1, 3], [1, 4], 2, 2)
    assert second.params_before == first.params_after
    assert second.params_after == num_params(model)

    text = str(second)
    assert "parameters:" in text and f"{second.params_before:,}" in text and f"{second.params_after:,}" in text
    assert "[1, 4]" in text
    data = second.to_dict()
    assert data["heads_removed"] == 2 and data["layers"][0]["removed_original"] == [1, 4]


@pytest.mark.parametrize("arch", ARCHS)
def test_summary_str_for_every_arch(arch):
    model = fresh(arch)
    n = layouts(model)[0].num_heads
    summary = sinv_prune.prune_heads(model, {1: list(range(n))}, allow_empty_layers=True)
    assert summary.layers[0].kept == 0 and summary.layers[0].kept_kv == 0
    lines = str(summary).splitlines()
    assert len(lines) == 3 and lines[1].split()[:4] == ["1", str(n), "0", "0"]


def test_empty_request_changes_no_weights():
    model = fresh("gpt2")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    summary = sinv_prune.prune_heads(model, {0: [], 2: []})
    assert summary.layers == [] and summary.params_before == summary.params_after
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_index_types_accepted():
    """Integers of any kind are fine (numpy, 0-d tensors, digit strings as JSON keys give)."""
    model = fresh("gpt2")
    ref = masked(model, "gpt2", {0: [1, 3], 2: [0]})
    sinv_prune.prune_heads(model, {np.int64(0): torch.tensor([1, 3]), "2": [np.int32(0)]})
    close(model_output(model, padded_inputs()), model_output(ref, padded_inputs()))


# -- bad requests --------------------------------------------------------------------------------


def _bad_requests(arch: str, num_heads: int, group: int):
    valid = list(range(group))  # the first KV group (one head without GQA): a valid removal
    out = [
        ({7: [0]}, {}, "unknown layer 7"),
        ({-1: [0]}, {}, "unknown layer -1"),
        ({0: [num_heads]}, {}, f"out of range 0..{num_heads - 1}"),
        ({0: [-1]}, {}, "out of range"),
        ({0: [1, 1]}, {}, "duplicate head indices [1]"),
        ({0: [1.0]}, {}, "must be an integer"),
        ({0: ["x"]}, {}, "must be an integer"),
        ({0: [True]}, {}, "must be an integer"),
        ({"first": [0]}, {}, "must be an integer"),
        ({0: 1}, {}, "heads must be a collection of head indices"),
        ({0: "12"}, {}, "heads must be a collection of head indices"),
        ({0: None}, {}, "heads must be a collection of head indices"),
        ({0: torch.tensor(1)}, {}, "heads must be a collection of head indices"),
        ({1: list(range(num_heads))}, {}, "allow_empty_layers=True"),
        ([0, 1], {}, "must map"),
        # A valid layer before an invalid one: nothing may change.
        ({0: valid, 2: [num_heads + 3]}, {}, "out of range"),
        ({0: valid, 1: list(range(num_heads))}, {}, "allow_empty_layers"),
        ({0: valid, 1: valid, "1": valid}, {}, "layer 1 is named more than once"),
    ]
    if arch == "llama":  # 6 heads, 2 KV heads: groups {0,1,2} and {3,4,5}
        out += [
            ({0: [0]}, {}, "GQA query groups would become unequal"),
            ({0: [0, 3, 4]}, {}, "unequal"),
            ({1: [1], 2: [0, 1, 2, 3, 4]}, {"allow_empty_layers": True}, "unequal"),
        ]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_requests_raise_and_change_nothing(arch):
    model = fresh(arch)
    inputs = padded_inputs()
    expected_out = model_output(model, inputs)
    snap = snapshot(model)
    lay = layouts(model)[0]
    for request, kwargs, message in _bad_requests(arch, lay.num_heads, lay.group_size):
        with pytest.raises(ValueError) as err:
            sinv_prune.prune_heads(model, request, **kwargs)
        assert message in str(err.value), (request, str(err.value))
        assert_unchanged(model, snap)
    assert torch.equal(model_output(model, inputs), expected_out)


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_request_on_a_pruned_model_changes_nothing(arch):
    model = fresh(arch)
    n = layouts(model)[0].num_heads
    group = n // layouts(model)[0].num_kv_heads
    sinv_prune.prune_heads(model, {0: list(range(group))})  # drop the first KV group (one head without GQA)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="out of range"):
        sinv_prune.prune_heads(model, {1: [0], 0: [n - group]})  # layer 0 now has n - group heads
    assert_unchanged(model, snap)


def test_duplicate_layer_keys_are_refused():
    """``{0: [...], "0": [...]}`` names layer 0 twice; silently applying one of them would be wrong."""
    model = fresh("gpt2")
    snap = snapshot(model)
    with pytest.raises(ValueError, match="layer 0 is named more than once"):
        sinv_prune.prune_heads(model, {0: [1], "0": [2]})
    assert_unchanged(model, snap)


def _tiny_opt():
    config = transformers.OPTConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=16,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config).eval()


def _tiny_t5():
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return transformers.T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("build", [_tiny_opt, _tiny_t5], ids=["opt", "t5"])
def test_unsupported_architecture(build):
    model = build()
    snap = snapshot(model)
    for call in (
        lambda: sinv_prune.prune_heads(model, {0: [0]}),
        lambda: sinv_prune.head_gates(model).__enter__(),
        lambda: get_adapter(model),
    ):
        with pytest.raises(ValueError) as err:
            call()
        message = str(err.value)
        assert f"unsupported architecture {model.config.model_type!r}" in message
        for supported in ("gpt2", "bert", "roberta", "llama", "qwen2", "mistral"):
            assert supported in message
    assert_unchanged(model, snap)


# -- dtype and device ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_preserved(arch, dtype):
    model = fresh(arch).to(dtype)
    request = {0: [0, 1] if arch != "llama" else [0, 1, 2], 2: list(range(layouts(model)[2].num_heads))}
    ref = masked(model, arch, request)
    sinv_prune.prune_heads(model, request, allow_empty_layers=True)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert all(p.requires_grad for p in model.parameters())
    out, want = model_output(model, padded_inputs()), model_output(ref, padded_inputs())
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want.float(), atol=0.05, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_prune_on_cuda(arch):
    _prune_on_device(arch, "cuda")


def _prune_on_device(arch: str, device: str) -> None:
    model = fresh(arch).to(device)
    request = {0: [0, 1] if arch != "llama" else [3, 4, 5], 1: list(range(layouts(model)[1].num_heads))}
    ref = masked(model, arch, request)
    sinv_prune.prune_heads(model, request, allow_empty_layers=True)
    assert {p.device.type for p in model.parameters()} == {device}
    assert [lay.num_heads for lay in layouts(model)][:2] == [layouts(ref)[0].num_heads - len(request[0]), 0]
    inputs = {k: v.to(device) for k, v in padded_inputs().items()}
    close(model_output(model, inputs), model_output(ref, inputs))
    with sinv_prune.head_gates(model) as gates:
        out = model(**inputs)
        (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().pow(2).mean().backward()
    assert all(g.device.type == device for g in gates)
    assert all(torch.isfinite(g.grad).all() and (g.grad != 0).all() for g in gates if g.numel())
    if arch in CAUSAL:
        kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert torch.equal(model.generate(**inputs, **kwargs), ref.generate(**inputs, **kwargs))
    for dtype in (torch.float16, torch.bfloat16):
        half = fresh(arch).to(device, dtype)
        sinv_prune.prune_heads(half, request, allow_empty_layers=True)
        assert {(p.device.type, p.dtype) for p in half.parameters()} == {(device, dtype)}
        assert torch.isfinite(model_output(half, inputs)).all()


def test_empty_request_changes_nothing():
    model = tiny_model("gpt2")
    summary = sinv_prune.prune_heads(model, {})
    assert summary.heads_removed == 0 and summary.params_before == summary.params_after
    assert type(model) is transformers.GPT2LMHeadModel
    assert not hasattr(model.config, "sinv_prune")
