"""Gates: a multiplier per head (or per MLP channel) on the input of the output (down) projection.

Michel et al. (2019, "Are Sixteen Heads Really Better than One?") score heads by
``|dL/d gate|``. Gating the concatenated head outputs just before the output
projection works the same under every attention implementation (eager, sdpa,
flash), and a gate of 0 is exactly the removal of that head. Channel gates do the
same for MLP channels at the down projection's input (a gate of 0 removes the channel,
bias of the down projection aside, which stays).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sinv_prune.arch import get_adapter


@contextmanager
def head_gates(model: nn.Module, *, requires_grad: bool = True) -> Iterator[list[torch.Tensor]]:
    """Within the block, head ``h`` of layer ``l`` is scaled by ``gates[l][h]`` (initially 1).

    The gates are float32 leaf tensors on each layer's device; with
    ``requires_grad=True`` a backward pass fills ``gates[l].grad`` (a layer left with no
    heads has an empty gate whose ``grad`` may stay ``None``).

    >>> with head_gates(model) as gates:
    ...     model(**batch).loss.backward()
    ...     scores = [g.grad.abs() for g in gates]
    """
    adapter = get_adapter(model)
    gates, handles = [], []
    try:
        for layer in range(adapter.num_layers):
            layout = adapter.layout(layer)
            proj = adapter.out_proj(layer)
            gate = torch.ones(layout.num_heads, device=proj.weight.device, requires_grad=requires_grad)
            gates.append(gate)
            handles.append(proj.register_forward_pre_hook(_gate_hook(gate, layout.head_dim)))
        yield gates
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def channel_gates(model: nn.Module, *, requires_grad: bool = True) -> Iterator[list[torch.Tensor]]:
    """Within the block, MLP channel ``j`` of layer ``l`` is scaled by ``gates[l][j]`` (initially 1).

    The gate multiplies the down projection's input (``adapter.mlp_out``), so it scales the
    channel after its activation (and after the gate product of gated MLPs). Float32 leaf
    tensors on each layer's device, as :func:`head_gates`.
    """
    adapter = get_adapter(model)
    gates, handles = [], []
    try:
        for layer in range(adapter.num_layers):
            if adapter.num_experts(layer):  # its MLP items are the channels inside the experts
                raise ValueError(
                    f"layer {layer} is a mixture-of-experts layer: MLP channel gates (taylor, allocation) cover dense "
                    "MLPs only; score the channels inside experts with magnitude or random"
                )
            down = adapter.mlp_out(layer)
            gate = torch.ones(adapter.intermediate_size(layer), device=down.weight.device, requires_grad=requires_grad)
            gates.append(gate)
            handles.append(down.register_forward_pre_hook(_gate_hook(gate, 1)))
        yield gates
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def expert_gates(model: nn.Module, *, requires_grad: bool = True) -> Iterator[list[torch.Tensor]]:
    """Within the block, routed expert ``e`` of layer ``l`` has its routing probability scaled by ``gates[l][e]``
    (initially 1; a dense layer gets an empty gate).

    The gate adds ``log(gate)`` to the expert's router logit and the layer routes again as its family
    does (softmax, top-k, renormalisation), so a gate of 0 is exactly the removal of that expert
    (logit -inf), which zeroing the expert's output would not be: its tokens go to other experts.
    """
    adapter = get_adapter(model)
    gates, handles = [], []
    try:
        for layer in range(adapter.num_layers):
            count = adapter.num_experts(layer)
            router = adapter.router(layer) if count else None
            device = router.weight.device if count else None
            device = torch.device("cpu") if device is not None and device.type == "meta" else device  # offloaded
            gate = torch.ones(count, device=device, requires_grad=requires_grad)
            gates.append(gate)
            if count:
                handles.append(router.register_forward_hook(_route_hook(adapter, layer, gate)))
        yield gates
    finally:
        for handle in handles:
            handle.remove()


def _route_hook(adapter, layer: int, gate: torch.Tensor):
    def hook(module, args, output):
        logits, *_ = output
        shifted = logits + torch.log(gate).to(logits.device, logits.dtype)
        return (shifted, *adapter.route(layer, shifted))

    return hook


def _gate_hook(gate: torch.Tensor, head_dim: int):
    def hook(module, args):
        (x, *rest) = args
        heads = x.unflatten(-1, (gate.numel(), head_dim))
        gated = (heads * gate.to(x.dtype)[:, None]).flatten(-2)
        return (gated, *rest)

    return hook
