"""Calibration passes of the criteria, one block at a time instead of one whole-model forward per batch.

A criterion that reads activations (``frequency``, ``reap``, ``ean``, ``activation``,
``block_influence``) hooks modules inside the blocks and runs the model on each batch. With
``compute(..., layer_by_layer=True)`` it runs through
:func:`~sinv_prune.surgery.layerwise.layer_by_layer` instead: every batch's hidden states wait on the
host, block ``i`` alone runs on the compute device over every batch with that block's hooks, and its
outputs become block ``i + 1``'s inputs. The hooks and the per-batch statistics are the same, and are
added up in the same order, so the scores equal the whole-model pass's to float rounding of the
block outputs. Alive at once: every batch's hidden states (tokens x hidden, on the host), one block
on the device and its activations for one batch, and the criterion's statistics (O(width) per layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["walk_layers"]

Attach = Callable[[int, int, dict], list[RemovableHandle]]
OnOutput = Callable[[int, int, dict, torch.Tensor, torch.Tensor], None]


def walk_layers(
    model: nn.Module,
    batches: list[Mapping[str, Any]],
    attach: Attach | None = None,
    on_output: OnOutput | None = None,
    *,
    layers: Iterable[int] | None = None,
    device: torch.device | str | None = None,
    desc: str = "layers",
) -> None:
    """Run ``batches`` through ``model`` block by block (eval mode, no gradients; modes restored).

    For block ``layer`` and batch ``j`` (``feed``: the batch as the model takes it, on its input
    device, without labels), ``attach(layer, j, feed)`` registers hooks on modules inside the block
    and returns their handles, removed once the block has run on that batch; ``on_output(layer, j,
    feed, input, output)`` sees the block's hidden input and output. ``layers`` stops after the last
    block it names; ``device`` is the compute device (default: the input embeddings').
    """
    from sinv_prune.arch import get_adapter
    from sinv_prune.surgery.layerwise import layer_by_layer

    feeds = [{k: v for k, v in batch.items() if k != "labels"} for batch in batches]
    for layer in layer_by_layer(model, get_adapter(model), feeds, device=device, layers=layers, desc=desc):
        feeds_now = [b.feed for b in layer.batches]
        handles: list[RemovableHandle] = []
        turn = [-1]

        def enter(module, args, layer=layer, feeds_now=feeds_now, handles=handles, turn=turn):
            turn[0] += 1
            if attach is not None:
                handles.extend(attach(layer.index, turn[0], feeds_now[turn[0]]))

        def leave(module, args, output, handles=handles):
            for handle in handles:
                handle.remove()
            handles.clear()

        seen = None
        if on_output is not None:
            seen = lambda j, x, y, layer=layer, feeds_now=feeds_now: on_output(layer.index, j, feeds_now[j], x, y)  # noqa: E731
        around = [layer.block.register_forward_pre_hook(enter), layer.block.register_forward_hook(leave)]
        try:
            layer.run(seen)
        finally:
            for handle in [*around, *handles]:
                handle.remove()
