"""Head gates: gradients reach them, a zero gate is a removed head, the hooks go away."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, model_output, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_surgery import close, fresh, head_dim_of, head_removals, layouts, masked, out_proj_weight, padded_inputs

import sinv_prune
from sinv_prune.arch import get_adapter


def _main_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _loss(out: torch.Tensor, inputs: dict) -> torch.Tensor:
    """A scalar of the output at real (unpadded) positions.

    Padded query positions are left out: eager and sdpa treat fully masked rows differently.
    """
    out = out.to(torch.promote_types(out.dtype, torch.float32)).pow(2)
    if out.dim() == 2:  # sequence classification: one row per example
        return out.mean()
    mask = inputs.get("attention_mask", torch.ones(out.shape[:2]))
    return (out.mean(-1) * mask).sum() / mask.sum()


def _gate_grads(model, inputs) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradients of a scalar loss with respect to every gate, and the gated output."""
    with sinv_prune.head_gates(model) as gates:
        out = _main_output(model(**inputs))
        _loss(out, inputs).backward()
    return [g.grad for g in gates], out.detach()


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_reach_gates_under_eager_and_sdpa(arch):
    inputs = padded_inputs()
    grads = {}
    for impl in ("eager", "sdpa"):
        model = tiny_model(arch, attn_implementation=impl)
        assert model.config._attn_implementation == impl
        plain = model_output(model, inputs)
        with sinv_prune.head_gates(model) as gates:
            assert [g.shape for g in gates] == [(lay.num_heads,) for lay in layouts(model)]
            assert all(g.dtype == torch.float32 and g.is_leaf and g.requires_grad for g in gates)
            assert all(torch.equal(g, torch.ones_like(g)) for g in gates)
            out = _main_output(model(**inputs))
            _loss(out, inputs).backward()
        # Gates of 1 leave the forward untouched.
        close(out.detach(), plain, atol=1e-6)
        for layer, g in enumerate(gates):
            assert g.grad is not None, (impl, layer)
            assert torch.isfinite(g.grad).all(), (impl, layer)
            assert (g.grad != 0).all(), (impl, layer, g.grad)
        grads[impl] = torch.stack([g.grad for g in gates])
    torch.testing.assert_close(grads["eager"], grads["sdpa"], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_gradient_is_the_derivative(arch):
    """With all gates at 1, dL/d gate_h = sum(W * dL/dW) over head h's input columns of the output projection.

    (y = W (g * x) makes both sides the sum over positions of dL/dy . W[:, h] x_h.)
    """
    model = fresh(arch)
    inputs = padded_inputs()
    grads, _ = _gate_grads(model, inputs)
    model.zero_grad()
    _loss(_main_output(model(**inputs)), inputs).backward()
    d = head_dim_of(model, arch)
    for layer, lay in enumerate(layouts(model)):
        weight, dim = out_proj_weight(model, arch, layer)
        contrib = (weight * weight.grad).detach().sum(dim=1 - dim)  # per input feature
        expected = contrib.unflatten(0, (lay.num_heads, d)).sum(-1)
        torch.testing.assert_close(grads[layer], expected, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_gate_zero_equals_removal(arch, data):
    model = fresh(arch)
    request = data.draw(head_removals(layouts(model), allow_empty=True), label="request")
    inputs = padded_inputs()
    ref = masked(model, arch, request)
    with sinv_prune.head_gates(model, requires_grad=False) as gates:
        assert not any(g.requires_grad for g in gates)
        for layer, heads in request.items():
            gates[layer][list(heads)] = 0.0
        gated = model_output(model, inputs)
    close(gated, model_output(ref, inputs))
    sinv_prune.prune_heads(model, request, allow_empty_layers=True)
    close(gated, model_output(model, inputs))


@pytest.mark.parametrize("arch", ARCHS)
def test_gates_on_a_pruned_model(arch):
    """Gates follow the pruned shapes, and kept heads get the gradients they had before removal."""
    model = fresh(arch)
    lay = layouts(model)[0]
    request = {0: list(range(lay.num_heads)), 2: list(range(lay.group_size, 2 * lay.group_size))}
    ref = masked(model, arch, request)
    sinv_prune.prune_heads(model, request, allow_empty_layers=True)
    inputs = padded_inputs()
    grads, out = _gate_grads(model, inputs)
    ref_grads, ref_out = _gate_grads(ref, inputs)
    close(out, ref_out)
    assert [g.numel() for g in gates_of(model)] == [0, lay.num_heads, lay.num_heads - lay.group_size]
    # Layer 0 has no heads: its gate is empty (GPT-2 never calls c_proj there, so no grad at all).
    assert grads[0] is None or grads[0].numel() == 0
    for layer in (1, 2):
        kept = [h for h in range(lay.num_heads) if h not in request.get(layer, ())]
        torch.testing.assert_close(grads[layer], ref_grads[layer][kept], atol=1e-6, rtol=1e-4)
        assert (grads[layer] != 0).all()


def gates_of(model) -> list[torch.Tensor]:
    with sinv_prune.head_gates(model, requires_grad=False) as gates:
        return gates


@pytest.mark.parametrize("arch", ARCHS)
def test_hooks_removed_after_exit(arch):
    model = fresh(arch)
    adapter = get_adapter(model)
    inputs = padded_inputs()
    plain = model_output(model, inputs)
    hooks = lambda: [len(adapter.out_proj(i)._forward_pre_hooks) for i in range(adapter.num_layers)]  # noqa: E731
    assert hooks() == [0] * adapter.num_layers

    with sinv_prune.head_gates(model) as gates:
        assert hooks() == [1] * adapter.num_layers
        for g in gates:
            g.data.zero_()
        assert (model_output(model, inputs) - plain).abs().max() > 1e-6
    assert hooks() == [0] * adapter.num_layers
    assert torch.equal(model_output(model, inputs), plain)

    with pytest.raises(RuntimeError, match="inside"), sinv_prune.head_gates(model) as gates:
        gates[1].data.zero_()
        raise RuntimeError("inside the block")
    assert hooks() == [0] * adapter.num_layers
    assert torch.equal(model_output(model, inputs), plain)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gates_on_half_precision_models(arch, dtype):
    model = fresh(arch).to(dtype)
    grads, out = _gate_grads(model, padded_inputs())
    assert out.dtype == dtype
    for g in grads:
        assert g.dtype == torch.float32 and torch.isfinite(g).all() and (g != 0).any()


def test_gate_scales_only_its_head():
    """Scaling one gate by 2 equals doubling that head's input columns of the output projection."""
    model = fresh("gpt2")
    ref = fresh("gpt2")
    inputs = padded_inputs()
    weight, dim = out_proj_weight(ref, "gpt2", 1)
    with torch.no_grad():
        weight.narrow(dim, 2 * 8, 8).mul_(2)
    with sinv_prune.head_gates(model, requires_grad=False) as gates:
        gates[1][2] = 2.0
        close(model_output(model, inputs), model_output(ref, inputs))
