"""One block at a time: calibration runs through a model's transformer blocks in order, each block alone.

Every calibration-reading path (shrink's statistics, compensation, the routing and activation
criteria, block influence) needs, per block, that block's inputs over the calibration tokens. A
whole-model pass with hooks on every layer keeps every layer's statistics alive at once; this
engine instead walks the blocks: the first block's inputs are caught once
(:func:`~sinv_prune.surgery.block_inputs.capture_block_inputs`), then for block ``i`` alone the
caller attaches its hooks, :meth:`Layer.run` runs the block over every batch, the caller uses or
stores what the hooks gathered, and the outputs become block ``i + 1``'s inputs.

Alive at once: the hidden states of every calibration batch (on the host, pinned where CUDA is
there; ``tokens x hidden`` in the model's dtype, one copy), one block on the compute device, its
activations for one batch, and whatever the caller keeps. Blocks that live elsewhere (on the CPU
with the work on a GPU, or behind accelerate's offload hooks) are brought to the compute device
for their turn only: an offloaded block's weights are brought in once for the turn
(:func:`~sinv_prune.surgery.offload.onloaded`: not read again for every batch, and hooks of the
caller that read the weights before accelerate's own would bring them see them), a plain block is
moved there and back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.progress import bar
from sinv_prune.surgery.block_inputs import BlockInput, capture_block_inputs, input_device, preserve_modes

__all__ = ["Layer", "block_device", "host_device", "layer_by_layer"]


def host_device() -> torch.device:
    """Where hidden states and statistics wait for their block: the CPU."""
    return torch.device("cpu")


def _to_host(x: torch.Tensor, pin: bool) -> torch.Tensor:
    x = x.detach().to("cpu")
    return x.pin_memory() if pin else x


def block_device(block: nn.Module) -> torch.device:
    """The device a block computes on: its accelerate hook's execution device, else its parameters' device."""
    hook = getattr(block, "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    if execution is not None:
        return torch.device(execution) if not isinstance(execution, int) else torch.device("cuda", execution)
    first = next(block.parameters(), None)
    if first is not None and first.device.type == "meta":  # offloaded below the block (cpu_offload's hooks)
        from sinv_prune.surgery.offload import compute_device

        return compute_device(block)
    return first.device if first is not None else torch.device("cpu")


@dataclass
class Layer:
    """Block ``index`` with its inputs over every calibration batch (``batches[j]``, hidden on the host)."""

    index: int
    block: nn.Module
    batches: list[BlockInput]
    hidden: list[torch.Tensor]
    device: torch.device
    pin: bool = False
    root: nn.Module | None = None  # the model (finds offload hooks above the block)
    outputs: list[torch.Tensor] | None = field(default=None, repr=False)

    def inputs(self) -> Iterator[tuple[BlockInput, torch.Tensor]]:
        """Each batch with this block's hidden input on the compute device."""
        for batch, hidden in zip(self.batches, self.hidden, strict=True):
            yield batch, hidden.to(self.device, non_blocking=self.pin)

    def forward(self, batch: BlockInput, hidden: torch.Tensor) -> torch.Tensor:
        """This block's output for one batch (hooks on the block fire)."""
        args, kwargs = batch.blocks[self.index]
        args = tuple(_moved(a, self.device) for a in args)
        kwargs = {k: _moved(v, self.device) for k, v in kwargs.items()}
        out = self.block(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run(self, on_output: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Run the block over every batch; its outputs (on the host) become the next block's inputs.

        ``on_output(j, input, output)`` sees batch ``j``'s input and output on the compute device.
        Called again (after the block changed), the later outputs replace the earlier ones.
        """
        outputs = []
        with torch.no_grad(), _on_device(self.block, self.device, self.root):
            for j, (batch, hidden) in enumerate(self.inputs()):
                out = self.forward(batch, hidden)
                if on_output is not None:
                    on_output(j, hidden, out)
                outputs.append(_to_host(out, self.pin))
        self.outputs = outputs
        return outputs


def layer_by_layer(
    model: nn.Module,
    adapter: HeadAdapter,
    calibration: Iterable,
    *,
    holdout: float = 0.0,
    device: torch.device | str | None = None,
    layers: Iterable[int] | None = None,
    quiet: bool = True,
    desc: str = "layers",
) -> Iterator[Layer]:
    """Yield each transformer block of ``model`` in order with its calibration inputs.

    The caller attaches hooks, calls :meth:`Layer.run` (or not: the block then runs after the
    caller is done with it) and detaches them; the outputs feed the next block. ``device`` is the
    compute device (default: the device of the input embeddings); ``layers`` stops the walk after
    the last block it names (blocks before it still run, to give it its inputs). ``holdout``
    marks a share of the sequences held out (:func:`~sinv_prune.surgery.block_inputs.mark_heldout`).
    """
    device = torch.device(device) if device is not None else input_device(model)
    pin = device.type == "cuda" and torch.cuda.is_available()
    batches = capture_block_inputs(model, adapter, calibration, holdout)
    hidden = [_to_host(b.hidden, pin) for b in batches]
    for b, h in zip(batches, hidden, strict=True):
        b.hidden = h  # one copy of the first block's inputs, on the host
    blocks = adapter.layers()
    wanted = set(range(len(blocks))) if layers is None else set(layers)
    last = max(wanted, default=-1)
    with preserve_modes(model):
        for index in bar(range(last + 1), desc=desc, unit="layer", disable=quiet):
            layer = Layer(index, blocks[index], batches, hidden, device, pin, model)
            if index in wanted:
                yield layer
            if index < last:
                hidden = layer.outputs if layer.outputs is not None else layer.run()


def _moved(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device) if value.device != device else value
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    return value


class _on_device:
    """Bring a plain block to ``device`` for its turn and put it back after; an offloaded block's weights are
    brought in by its hooks for the turn (:func:`~sinv_prune.surgery.offload.onloaded`); other hooked blocks stay."""

    def __init__(self, block: nn.Module, device: torch.device, root: nn.Module | None = None):
        self.block, self.device, self.root = block, device, root
        self.home = None
        self.onloaded = None

    def __enter__(self):
        from sinv_prune.surgery.offload import is_offloaded, onloaded

        if is_offloaded(self.block) or any(t.device.type == "meta" for t in self.block.parameters()):
            self.onloaded = onloaded(self.block, self.root)
            self.onloaded.__enter__()
        elif not any(hasattr(m, "_hf_hook") for m in self.block.modules()):
            home = block_device(self.block)
            if home != self.device:
                self.home = home
                self.block.to(self.device)
        return self.block

    def __exit__(self, *exc):
        if self.onloaded is not None:
            self.onloaded.__exit__(*exc)
        if self.home is not None:
            self.block.to(self.home)
