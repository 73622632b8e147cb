"""A candidate plan applied without surgery, and its fitness: KL to the unpruned model on held-out tokens.

Removing heads or channels is exactly zeroing their columns in the consumer (``o_proj``, the down
projection), so a candidate writes, per layer, its refitted kept columns into a full-width weight
with zeros elsewhere; a dropped block's ``forward`` returns its input; a removed expert's gate is 0
(:func:`~sinv_prune.scoring.gates.expert_gates`: its router logit ``-inf``, the router routing again as
the family does, which is exactly what the sliced router computes). Nothing is sliced, so going from
one candidate to the next rewrites only the layers that differ. :class:`Candidates` is a context
manager: on exit every consumer gets its own parameters back, every block its forward and every
router its own output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.arch.base import linear_weight
from sinv_prune.scoring.criteria.base import preserve_modes
from sinv_prune.scoring.gates import expert_gates
from sinv_prune.shrink.space import Genome
from sinv_prune.shrink.statistics import Picks
from sinv_prune.surgery.block_inputs import input_device
from sinv_prune.surgery.consumer_statistics import consumer_modules
from sinv_prune.surgery.refit import write_consumer
from sinv_prune.units.heads import HEADS
from sinv_prune.units.mlp import MLP


def _passthrough(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


class Candidates:
    """Apply genomes to ``model`` in place (masks and refits, not slices) and measure their KL."""

    def __init__(self, model: nn.Module, adapter: HeadAdapter, picks: Picks, batches: Sequence[torch.Tensor]):
        self.model, self.adapter, self.picks = model, adapter, picks
        self.batches = list(batches)
        self._modules = consumer_modules(adapter)
        self._saved = {k: (m.weight, getattr(m, "bias", None)) for k, m in self._modules.items()}
        self._applied: dict[tuple[str, int], tuple] = {}
        self._dropped: set[int] = set()
        self.reference: list[torch.Tensor] = []
        self._modes = None
        self._gates_context = None
        self._gates: list[torch.Tensor] = []  # per layer the expert gates (1 kept, 0 removed; empty: dense)

    def __enter__(self) -> Candidates:
        self._modes = preserve_modes(self.model)
        self._modes.__enter__()
        self._gates_context = expert_gates(self.model, requires_grad=False)
        self._gates = self._gates_context.__enter__()
        self.model.eval()
        with torch.no_grad():
            self.reference = [torch.log_softmax(self.logits(b), -1) for b in self.batches]
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.reset()
        finally:
            self._gates_context.__exit__(*exc)
            self._gates = []
            self.reference = []
            self._modes.__exit__(*exc)

    def reset(self) -> None:
        """The unpruned model again: original parameters, every block's own forward."""
        for key in list(self._applied):
            self._restore(key)
        for layer in list(self._dropped):
            del self.adapter.layers()[layer].forward
        self._dropped.clear()
        for gate in self._gates:
            gate.fill_(1.0)

    def _restore(self, key) -> None:
        module = self._modules[key]
        weight, bias = self._saved[key]
        module.weight = weight
        if bias is not None:
            module.bias = bias
        self._applied.pop(key, None)

    def apply(self, genome: Genome) -> None:
        """Make the model compute as ``genome``'s plan would (up to the refits being per-layer)."""
        blocks = self.adapter.layers()
        for layer in range(len(blocks)):
            drop = layer in genome.dropped
            if drop and layer not in self._dropped:
                blocks[layer].forward = _passthrough
                self._dropped.add(layer)
            elif not drop and layer in self._dropped:
                del blocks[layer].forward
                self._dropped.discard(layer)
            heads = [] if drop else self.picks.heads(layer, genome.heads[layer])
            self._set((HEADS.name, layer), heads)
            if self.adapter.num_experts(layer):
                self._gates[layer].fill_(1.0)
                if not drop:
                    self._gates[layer][self.picks.experts(layer, genome.expert_cut(layer))] = 0.0
            else:
                self._set((MLP.name, layer), [] if drop else self.picks.channels(layer, genome.mlp[layer]))

    def _set(self, key: tuple[str, int], removed: list[int]) -> None:
        state = tuple(removed)
        if self._applied.get(key, ()) == state:
            return
        if not removed:
            self._restore(key)
            return
        kept, weight, bias = self.picks.refit(key[0], key[1], removed)
        original = self._saved[key][0]
        full = torch.zeros(weight.shape[0], self._width(key), dtype=weight.dtype, device=weight.device)
        full[:, kept] = weight
        write_consumer(self._modules[key], full, bias)
        self._modules[key].weight.requires_grad_(original.requires_grad)
        self._applied[key] = state

    def _width(self, key) -> int:
        return linear_weight(self._modules[key]).shape[1]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        device = input_device(self.model)
        return self.model(input_ids=ids.to(device), use_cache=False).logits.float()

    def kl(self, genome: Genome) -> float:
        """Mean per-token KL(unpruned || candidate) over the fitness batches."""
        self.apply(genome)
        total, count = 0.0, 0
        with torch.no_grad():
            for ref, ids in zip(self.reference, self.batches, strict=True):
                logp = torch.log_softmax(self.logits(ids), -1)
                kl = (ref.exp() * (ref - logp)).sum(-1)
                total += float(kl.sum())
                count += kl.numel()
        return total / max(count, 1)
