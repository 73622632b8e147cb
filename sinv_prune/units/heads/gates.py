"""Head gates: a multiplier per head on the input of the output projection.

Michel et al. (2019, "Are Sixteen Heads Really Better than One?") score heads by
``|dL/d gate|``. Gating the concatenated head outputs just before the output
projection works the same under every attention implementation (eager, sdpa,
flash), and a gate of 0 is exactly the removal of that head (channel gates,
:mod:`sinv_prune.units.mlp.gates`, do the same for MLP channels).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.units.common import gate_hook


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
            handles.append(proj.register_forward_pre_hook(gate_hook(gate, layout.head_dim)))
        yield gates
    finally:
        for handle in handles:
            handle.remove()
