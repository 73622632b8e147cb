"""Compensation at prune time (``prune_heads(..., calibration=, compensate=)``) on tiny models, plus SmolLM2."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import model_inputs, model_output, tiny_model

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import head_rows
from sinv_prune.surgery.refit import ConsumerFit
from sinv_prune.units.heads import plan_removal
from sinv_prune.units.heads.cuts import apply_layer

# Heads removed per architecture: several layers, and under GQA a whole KV group (llama layer 1).
HEADS = {
    "gpt2": {0: [1], 1: [0, 2, 3], 2: [2]},
    "bert": {0: [1], 1: [0, 2, 3], 2: [2]},
    "roberta": {0: [3], 2: [0, 1]},
    "llama": {0: [0, 4], 1: [0, 1, 2], 2: [2, 3]},
    "qwen2": {0: [1, 3, 5], 2: [0, 1]},
    "mistral": {0: [0, 2], 1: [2, 3]},
}


def calibration(batches: int = 4, batch: int = 4, length: int = 16, seed: int = 100, pad: bool = False) -> list:
    """Random-token batches; with ``pad``, the rows of every batch end in a different amount of padding."""
    out = []
    for b in range(batches):
        inputs = model_inputs(seed=seed + b, batch=batch, length=length)
        if pad:
            mask = torch.ones_like(inputs["input_ids"])
            for row in range(batch):
                mask[row, length - row * 3 :] = 0
            inputs["attention_mask"] = mask
        out.append(inputs)
    return out


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, saved_state: dict, saved_config: dict, cls: type) -> None:
    assert type(model) is cls
    assert model.config.to_dict() == saved_config
    now = model.state_dict()
    assert now.keys() == saved_state.keys()
    assert all(torch.equal(now[k], saved_state[k]) for k in now)


def run_hooked(model, batches, handles) -> None:
    """Run ``model`` over ``batches``, then remove the hooks ``handles``, whatever happens."""
    try:
        for batch in batches:
            model_output(model, batch)
    finally:
        for h in handles:
            h.remove()


def consumer_io(model, batches) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the output projection's (input rows, output rows) over ``batches``, padding dropped."""
    adapter, seen = get_adapter(model), {}
    handles = []
    for layer in range(adapter.num_layers):

        def hook(module, args, output, layer=layer):
            seen.setdefault(layer, []).append(
                (args[0].reshape(-1, args[0].shape[-1]), output.reshape(-1, output.shape[-1]))
            )

        handles.append(adapter.out_proj(layer).register_forward_hook(hook))
    run_hooked(model, batches, handles)
    result = {}
    for layer, pairs in seen.items():
        valid = [b["attention_mask"].reshape(-1).bool() if "attention_mask" in b else None for b in batches]
        xs = [x if v is None else x[v] for (x, _), v in zip(pairs, valid, strict=True)]
        ys = [y if v is None else y[v] for (_, y), v in zip(pairs, valid, strict=True)]
        result[layer] = (torch.cat(xs).double(), torch.cat(ys).double())
    return result


def relative_error(x, y, module) -> float:
    """``|x W^T + b - y| / |y|`` for a Linear or Conv1D ``module``, in float64."""
    weight = sinv_prune.arch.base.linear_weight(module).detach().double()
    out = x @ weight.T
    if getattr(module, "bias", None) is not None:
        out = out + module.bias.detach().double()
    return float((out - y).norm() / y.norm())


# -- exactness on a linearly redundant head --------------------------------------------------------------


def make_redundant(model, layer: int, head: int, source: int, seed: int) -> None:
    """Make ``head`` of ``layer`` attend like ``source`` with values ``A v_source``: its output is ``A o_source``.

    Under GQA two heads of one KV group share their keys and values, so equal queries make them equal (A = I).
    """
    adapter = get_adapter(model)
    p, layout = adapter.projections(layer), adapter.layout(layer)
    d = layout.head_dim
    h, s = slice(head * d, (head + 1) * d), slice(source * d, (source + 1) * d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        p.q[h] = p.q[s]
        if p.q_bias is not None:
            p.q_bias[h] = p.q_bias[s]
        if layout.group_size == 1:
            a = 4 * torch.randn(d, d, generator=g) / d**0.5  # a large head, so that losing it shows
            p.k[h] = p.k[s]
            p.v[h] = a @ p.v[s]
            if p.k_bias is not None:
                p.k_bias[h] = p.k_bias[s]
                p.v_bias[h] = a @ p.v_bias[s]
        else:
            assert head // layout.group_size == source // layout.group_size


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_lsq_reproduces_a_block_whose_removed_head_is_redundant(arch):
    model = tiny_model(arch)
    # removed head <- the kept head it copies; under GQA one per KV group, so the groups stay equal
    copies = {0: {1: 2, 4: 5}, 2: {3: 5, 0: 1}} if arch == "llama" else {0: {1: 2}, 2: {3: 0}}
    for layer, pairs in copies.items():
        for head, source in pairs.items():
            make_redundant(model, layer, head, source, seed=layer + head)
    reference, plain = copy.deepcopy(model), copy.deepcopy(model)
    heads = {layer: list(pairs) for layer, pairs in copies.items()}
    sinv_prune.prune_heads(plain, heads)
    summary = sinv_prune.prune_heads(
        model, heads, calibration=calibration(), compensate="lsq", ridge=1e-10, precision="float64"
    )

    inputs = model_inputs(seed=7, batch=3, length=20)
    expected = model_output(reference, inputs)
    assert (model_output(plain, inputs) - expected).abs().max() > 1e-2  # plain pruning loses the heads
    torch.testing.assert_close(model_output(model, inputs), expected, atol=1e-4, rtol=0)
    assert [f.layer for f in summary.compensation.layers] == [0, 2]
    assert all(f.error_before > 1e-2 and f.error_after < 1e-5 for f in summary.compensation.layers)


# -- bias (FLAP) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_bias_compensation_adds_the_removed_heads_mean_contribution(arch):
    model = tiny_model(arch)
    heads = HEADS[arch]
    batches = calibration(pad=True)
    adapter = get_adapter(model)
    io = consumer_io(model, batches)
    expected = {}
    for layer, removed in heads.items():
        proj = adapter.out_proj(layer)
        weight = sinv_prune.arch.base.linear_weight(proj).detach().double()
        bias = proj.bias.detach().double() if proj.bias is not None else torch.zeros(weight.shape[0]).double()
        cols = head_rows(torch.tensor(removed), adapter.layout(layer).head_dim)
        expected[layer] = bias + weight[:, cols] @ io[layer][0][:, cols].mean(0)
    plain = copy.deepcopy(model)
    sinv_prune.prune_heads(plain, heads)

    summary = sinv_prune.prune_heads(
        model, heads, calibration=batches, compensate="bias", add_bias=arch == "llama", holdout=0
    )

    assert summary.compensation.tokens == sum(int(b["attention_mask"].sum()) for b in batches)
    assert summary.compensation.bias_added == (arch == "llama")
    adapter, plain_adapter = get_adapter(model), get_adapter(plain)
    for layer in range(adapter.num_layers):
        proj, plain_proj = adapter.out_proj(layer), plain_adapter.out_proj(layer)
        assert torch.equal(proj.weight, plain_proj.weight)  # bias compensation leaves the weights alone
        if layer in heads:
            torch.testing.assert_close(proj.bias.double(), expected[layer], atol=1e-6, rtol=1e-6)
        elif plain_proj.bias is not None:
            assert torch.equal(proj.bias, plain_proj.bias)
        else:
            assert not proj.bias.any()


def test_bias_compensation_without_a_bias_is_refused():
    model = tiny_model("llama")
    saved, config = state(model), model.config.to_dict()
    with pytest.raises(ValueError, match="needs an output-projection bias.*add_bias=True"):
        sinv_prune.prune_heads(model, {0: [0]}, calibration=calibration(), compensate="bias")
    assert_unchanged(model, saved, config, type(model))


# -- lsq never does worse than plain pruning ----------------------------------------------------------------


def test_lsq_never_increases_a_layers_error_over_plain_pruning(arch):
    model = tiny_model(arch)
    heads = HEADS[arch]
    batches = calibration(pad=arch in ("gpt2", "bert", "llama"))
    targets = consumer_io(model, batches)  # the unpruned consumers' outputs
    plain = copy.deepcopy(model)
    sinv_prune.prune_heads(plain, heads)

    summary = sinv_prune.prune_heads(
        model, heads, calibration=batches, compensate="lsq", holdout=0, precision="float64"
    )

    seen = consumer_io(model, batches)  # the inputs each compensated consumer really gets
    adapter, plain_adapter = get_adapter(model), get_adapter(plain)
    fits = {f.layer: f for f in summary.compensation.layers}
    assert sorted(fits) == sorted(heads)
    for layer in heads:
        x, y = seen[layer][0], targets[layer][1]
        before = relative_error(x, y, plain_adapter.out_proj(layer))
        after = relative_error(x, y, adapter.out_proj(layer))
        assert after <= before
        assert after < 0.9 * before  # and a refit that does nothing would not pass
        assert fits[layer].error_before == pytest.approx(before, rel=1e-4)
        assert fits[layer].error_after == pytest.approx(after, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lsq_on_an_emptied_layer_fits_only_the_bias(arch):
    model = tiny_model(arch)
    num_heads = get_adapter(model).layout(1).num_heads
    batches = calibration()
    targets = consumer_io(model, batches)
    summary = sinv_prune.prune_heads(
        model, {1: list(range(num_heads))}, allow_empty_layers=True, calibration=batches, compensate="lsq",
        add_bias=arch == "llama", holdout=0, precision="float64",
    )  # fmt: skip
    proj = get_adapter(model).out_proj(1)
    torch.testing.assert_close(proj.bias.double(), targets[1][1].mean(0), atol=1e-6, rtol=1e-6)
    assert summary.compensation.layers[0].kept_columns == 0


# -- the API: unchanged without compensation, refusals, rollback, save/reload --------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_compensate_none_prunes_exactly_as_plain_slicing(arch):
    heads = HEADS[arch]
    default, explicit, manual = tiny_model(arch), tiny_model(arch), tiny_model(arch)
    summary = sinv_prune.prune_heads(default, heads)
    sinv_prune.prune_heads(explicit, heads, calibration=None, compensate=None)
    adapter = get_adapter(manual)
    for layer, (_, keep_q, keep_kv) in plan_removal(adapter, heads).items():
        apply_layer(adapter, layer, keep_q, keep_kv)
    assert summary.compensation is None and "compensation" not in summary.to_dict()
    for other in (explicit, manual):
        theirs = other.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in default.state_dict().items())
    assert explicit.config.to_dict() == default.config.to_dict()


BAD = [
    ("gpt2", dict(compensate="lsq"), "needs calibration batches"),
    ("gpt2", dict(calibration="CAL"), "only used with compensate"),
    ("gpt2", dict(add_bias=True), "add_bias is only used"),
    ("gpt2", dict(compensate="ols", calibration="CAL"), "unknown compensation 'ols'"),
    ("gpt2", dict(compensate="lsq", calibration="CAL", ridge=-1.0), "ridge must be"),
    ("gpt2", dict(compensate="lsq", calibration="CAL", ridge=float("nan")), "ridge must be"),
    ("gpt2", dict(compensate="lsq", calibration=[]), "holds no batches"),
    ("gpt2", dict(compensate="lsq", calibration={"input_ids": 1}), "iterable of batches"),
    ("bert", dict(compensate="lsq", calibration=[{"ids": torch.ones(1, 4, dtype=torch.long)}]), "batch 0 is not"),
    ("llama", dict(compensate="bias", calibration="CAL"), "needs an output-projection bias"),
    ("mistral", dict(compensate="lsq", calibration="CAL", add_bias=True), "no config.attention_bias"),
    ("qwen2", dict(compensate="bias", calibration="CAL", add_bias=True), "no config.attention_bias"),
]


@pytest.mark.parametrize(("arch", "kwargs", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_compensation_arguments_raise_before_anything_changes(arch, kwargs, message):
    model = tiny_model(arch)
    kwargs = {k: calibration(batches=1) if v == "CAL" else v for k, v in kwargs.items()}
    saved, config = state(model), model.config.to_dict()
    with pytest.raises(ValueError, match=message):
        sinv_prune.prune_heads(model, {0: [0]}, **kwargs)
    assert_unchanged(model, saved, config, type(model))


@pytest.mark.parametrize(("arch", "add_bias"), [("gpt2", False), ("llama", True)])
def test_a_failure_during_compensation_restores_the_model(arch, add_bias, monkeypatch):
    model = tiny_model(arch)
    saved, config, cls = state(model), model.config.to_dict(), type(model)
    calls = []
    solve = ConsumerFit.solve

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("solver failed")
        return solve(self, *args, **kwargs)

    monkeypatch.setattr(ConsumerFit, "solve", failing)
    with pytest.raises(RuntimeError, match="solver failed"):
        heads = {0: HEADS[arch][0], 2: HEADS[arch][2]}  # layer 1 untouched: add_bias still changed it
        sinv_prune.prune_heads(model, heads, calibration=calibration(), compensate="lsq", add_bias=add_bias)
    assert len(calls) == 2  # the first layer was already sliced and refitted
    assert_unchanged(model, saved, config, cls)
    if add_bias:
        assert all(get_adapter(model).out_proj(i).bias is None for i in range(3))
    torch.testing.assert_close(model_output(model, model_inputs()), model_output(tiny_model(arch), model_inputs()))


@pytest.mark.parametrize(("arch", "heads", "add_bias"), [
    ("gpt2", HEADS["gpt2"], False),               # reloads through the shipped remote code
    ("llama", {0: [0, 3], 1: [1, 4], 2: [2, 5]}, True),  # uniform cut: reloads on the stock class
])  # fmt: skip
def test_compensated_models_save_and_reload(arch, heads, add_bias, tmp_path):
    model = tiny_model(arch)
    sinv_prune.prune_heads(model, heads, calibration=calibration(), compensate="lsq", add_bias=add_bias)
    model.save_pretrained(tmp_path)
    inputs = model_inputs(seed=5, length=12)
    expected = model_output(model, inputs)
    again = sinv_prune.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(model_output(again, inputs), expected)
    if add_bias:
        stock = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert stock.config.attention_bias and stock.model.layers[0].self_attn.o_proj.bias is not None
        assert torch.equal(model_output(stock, inputs), expected)


# -- real weights ---------------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_lsq_compensation_improves_perplexity():
    from conftest import smollm2_gguf, smollm2_model, wikitext

    from sinv_prune.pipeline.evaluation import perplexity

    gguf = smollm2_gguf()
    valid, test = wikitext("valid"), wikitext("test")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    calib_ids = tokenizer(valid[:20000], return_tensors="pt").input_ids[0, : 2 * 256].reshape(2, 256)
    test_ids = tokenizer(test[:12000], return_tensors="pt").input_ids[0, :1024]
    model = smollm2_model()
    layout = get_adapter(model).layout(0)
    g = torch.Generator().manual_seed(0)
    heads = {  # one random query head per KV group in every third layer
        layer: [kv * layout.group_size + int(torch.randint(layout.group_size, (1,), generator=g))
                for kv in range(layout.num_kv_heads)]
        for layer in range(0, 30, 3)
    }  # fmt: skip
    plain = copy.deepcopy(model)
    sinv_prune.prune_heads(plain, heads)
    plain_ppl = perplexity(plain, test_ids, seq_len=256, progress=False)["perplexity"]
    del plain
    batches = [{"input_ids": row[None]} for row in calib_ids]
    summary = sinv_prune.prune_heads(model, heads, calibration=batches, compensate="lsq")
    ppl = perplexity(model, test_ids, seq_len=256, progress=False)["perplexity"]
    assert all(f.error_after < f.error_before for f in summary.compensation.layers)
    assert ppl < plain_ppl, (ppl, plain_ppl)
