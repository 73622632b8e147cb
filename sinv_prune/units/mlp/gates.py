"""Channel gates: a multiplier per MLP channel at the down projection's input (a gate of 0 removes the channel,
bias of the down projection aside, which stays), as :mod:`sinv_prune.units.heads.gates` does for heads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.units.common import gate_hook


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
            handles.append(down.register_forward_pre_hook(gate_hook(gate, 1)))
        yield gates
    finally:
        for handle in handles:
            handle.remove()
