"""Catch what a model passes each of its transformer blocks, so the blocks can be run one at a time.

Compensation (:mod:`sinv_prune.surgery.compensation`) runs the blocks of a model one by one over
calibration tokens. Each block needs the hidden states (the previous block's output) and its own
other inputs: attention mask, position embeddings, position ids. Models that mix layer types
(Qwen2 or Mistral with sliding windows on some layers, Gemma-style local/global attention) give
each block a different mask, so :func:`capture_block_inputs` catches every block's inputs: during
one forward per batch each block's ``forward`` is swapped for one that records its arguments and
returns its hidden input unchanged (no block computes), and the last one stops the forward before
the output head. Alive afterwards: the first block's hidden input per batch and references to the
model's masks and position tensors (shared by the blocks that share them).

A share of the calibration sequences is held out (:attr:`BlockInput.heldout`): compensation fits
on the rest and checks on these that a refit really helps.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from sinv_prune.arch import HeadAdapter

#: Share of the calibration sequences held out to check each refit (at least one sequence).
HOLDOUT = 0.125


class Stop(Exception):
    """Raised by a hook to end a forward once it has what it needs."""


@dataclass
class BlockInput:
    """One calibration batch: the first block's hidden input, every block's other inputs, the tokens that count.

    ``blocks[i]`` is ``(args, kwargs)`` of block ``i`` without its hidden states. ``valid`` marks
    the tokens that are not padding (``[batch * seq]``, None: all), ``heldout`` the valid tokens
    held out from fitting (one entry per valid token, None: none). ``feed`` is the batch as the
    model takes it (on the model's device), ``positions`` marks held-out tokens as ``[batch, seq]``.
    """

    hidden: torch.Tensor
    blocks: list[tuple[tuple, dict]]
    valid: torch.Tensor | None
    feed: dict
    heldout: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def run(self, block: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block ``index``'s output for hidden states ``hidden``."""
        args, kwargs = self.blocks[index]
        out = block(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @property
    def tokens(self) -> int:
        return int(self.valid.sum()) if self.valid is not None else self.hidden.shape[:-1].numel()


def capture_block_inputs(
    model: nn.Module, adapter: HeadAdapter, calibration: Iterable, holdout: float = HOLDOUT
) -> list[BlockInput]:
    """Run ``model`` on every batch with its blocks bypassed, keeping each block's inputs (nothing changes).

    ``holdout`` of the sequences (spread evenly, at least one where there are two or more; with
    a single sequence, its last ``holdout`` of tokens) are marked held out; 0 holds out nothing.
    """
    blocks = adapter.layers()
    device = input_device(model)
    extra = {"use_cache": False} if "use_cache" in set(inspect.signature(model.forward).parameters) else {}
    seen: list[tuple[tuple, dict]] = []
    inputs: list[BlockInput] = []
    with _bypassed(blocks, seen), preserve_modes(model), torch.no_grad():
        for number, batch in enumerate(calibration):
            if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
                raise ValueError(f"calibration batch {number} is not a dict with an input_ids tensor")
            feed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            feed.pop("labels", None)
            seen.clear()
            with contextlib.suppress(Stop):
                model(**feed, **extra)
            if len(seen) != len(blocks):
                raise ValueError(f"calibration batch {number} never reached the transformer blocks")
            inputs.append(_block_input(list(seen), feed))
    if not inputs:
        raise ValueError("calibration holds no batches")
    mark_heldout(inputs, holdout)
    return inputs


@contextlib.contextmanager
def _bypassed(blocks: list[nn.Module], seen: list):
    """Swap every block's forward for one that records its inputs and passes its hidden states through."""
    saved = [vars(block).get("forward") for block in blocks]

    def catcher(last: bool):
        def forward(*args, **kwargs):
            seen.append((args, kwargs))
            if last:
                raise Stop
            return args[0] if args else kwargs["hidden_states"]

        return forward

    for i, block in enumerate(blocks):
        block.forward = catcher(i == len(blocks) - 1)
    try:
        yield
    finally:
        for block, forward in zip(blocks, saved, strict=True):
            del block.forward
            if forward is not None:
                block.forward = forward


def _block_input(seen: list[tuple[tuple, dict]], feed: dict) -> BlockInput:
    hidden, per_block = None, []
    for args, kwargs in seen:
        kwargs = {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}
        if args:
            h, rest = args[0], tuple(None if isinstance(a, Cache) else a for a in args[1:])
        else:
            h, rest = kwargs.pop("hidden_states"), ()
        hidden = h if hidden is None else hidden
        per_block.append((rest, kwargs))
    mask = feed.get("attention_mask")
    valid = None if mask is None else mask.reshape(-1).to(hidden.device).bool()
    return BlockInput(hidden, per_block, valid, feed)


def mark_heldout(inputs: list[BlockInput], share: float) -> None:
    """Set ``heldout``/``positions`` of every batch: ``share`` of the sequences, spread evenly."""
    rows = [i.hidden.shape[0] for i in inputs]
    total = sum(rows)
    if share <= 0 or not total:
        return
    if total == 1:  # one sequence: hold out its tail
        length = inputs[0].hidden.shape[1]
        positions = torch.zeros(1, length, dtype=torch.bool, device=inputs[0].hidden.device)
        positions[0, length - max(1, round(length * share)) :] = True
        _set(inputs[0], positions)
        return
    count = min(total - 1, max(1, round(total * share)))
    chosen = {(j + 1) * total // count - 1 for j in range(count)}
    start = 0
    for inp, n in zip(inputs, rows, strict=True):
        picked = torch.tensor([start + r in chosen for r in range(n)], device=inp.hidden.device)
        _set(inp, picked[:, None].expand(n, inp.hidden.shape[1]).clone())
        start += n


def _set(inp: BlockInput, positions: torch.Tensor) -> None:
    inp.positions = positions
    flat = positions.reshape(-1)
    inp.heldout = flat if inp.valid is None else flat[inp.valid]


def input_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.device.type == "meta":  # offloaded: where its accelerate hook runs it
        from sinv_prune.surgery.offload import compute_device

        return compute_device(embeddings)
    return weight.device if weight is not None else next(model.parameters()).device


def rows(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Tokens as rows ``[n, features]``, padding dropped."""
    x = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # not -1: a layer without heads has zero features
    return x if valid is None else x[valid]


class preserve_modes:
    """Context manager: set ``model`` to eval (or train) mode, restore every module's mode after."""

    def __init__(self, model: nn.Module, train: bool = False):
        self.model, self.train = model, train

    def __enter__(self) -> nn.Module:
        self._modes = [(m, m.training) for m in self.model.modules()]
        self.model.train(self.train)
        return self.model

    def __exit__(self, *exc) -> None:
        for module, mode in self._modes:
            module.training = mode
