"""Expert gates: a multiplier per routed expert on its routing probability (taylor's scores, shrink's fitness)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sinv_prune.arch import get_adapter


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
