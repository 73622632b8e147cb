"""A candidate plan applied without surgery, and its fitness: KL to the unpruned model on held-out tokens.

Removing heads or channels is exactly zeroing their columns in the consumer (``o_proj``, the down
projection), so a candidate writes, per layer, its refitted kept columns into a full-width weight
with zeros elsewhere; a dropped block's ``forward`` returns its input; a removed expert's gate is 0
(:func:`~sinv_prune.scoring.gates.expert_gates`: its router logit ``-inf``, the router routing again as
the family does, which is exactly what the sliced router computes). Nothing is sliced, so going from
one candidate to the next rewrites only the layers that differ. :class:`Candidates` is a context
manager: on exit every consumer gets its own parameters back, every block its forward and every
router its own output.

The fitness forward starts where the candidate first differs from the one measured before it: every
block's output over the fitness batches is kept on the host for the last candidate measured (at first
the unpruned model), and the blocks before the first layer whose cut differs return those outputs
instead of computing (the model's own forward still runs the embeddings, the later blocks and the head).
A child of the search differs from the candidate before it in a few layers, so on average about half the
blocks run. Kept: ``layers x fitness tokens x hidden`` in the model's dtype.
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
        self._anchor: list[tuple] = []  # per layer the cut of the candidate whose block outputs are kept
        self._outputs: list[list[torch.Tensor]] = []  # [batch][layer] that candidate's block outputs (host)
        #: Blocks run by the fitness forwards so far, and blocks a full forward each time would have run.
        self.blocks_run, self.blocks_total = 0, 0
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
            self.reference = [torch.log_softmax(self._fitness_logits(b, j), -1) for j, b in enumerate(self.batches)]
        self._anchor = self._cut()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.reset()
        finally:
            self._gates_context.__exit__(*exc)
            self._gates = []
            self.reference, self._outputs, self._anchor = [], [], []
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
        cut = self._cut()
        first = next((i for i, (a, b) in enumerate(zip(self._anchor, cut, strict=True)) if a != b), len(cut))
        total, count = 0.0, 0
        with torch.no_grad():
            for j, (ref, ids) in enumerate(zip(self.reference, self.batches, strict=True)):
                logp = torch.log_softmax(self._fitness_logits(ids, j, first), -1)
                kl = (ref.exp() * (ref - logp)).sum(-1)
                total += float(kl.sum())
                count += kl.numel()
        self._anchor = cut
        return total / max(count, 1)

    def _cut(self) -> list[tuple]:
        """Per layer what the applied candidate changes there (the block's output depends on nothing else)."""
        out = []
        for layer in range(self.adapter.num_layers):
            gate = self._gates[layer] if layer < len(self._gates) else None
            closed = () if gate is None or not gate.numel() else tuple((gate == 0).nonzero().flatten().tolist())
            out.append((layer in self._dropped, self._applied.get((HEADS.name, layer), ()),
                        self._applied.get((MLP.name, layer), ()), closed))  # fmt: skip
        return out

    def _fitness_logits(self, ids: torch.Tensor, batch: int, first: int = 0) -> torch.Tensor:
        """Logits of fitness batch ``batch``: blocks before ``first`` give the kept outputs, the rest run (and
        their outputs are kept for the next candidate)."""
        blocks = self.adapter.layers()
        kept = self._outputs[batch] if batch < len(self._outputs) else None
        first = first if kept is not None else 0
        if kept is None:
            kept = [None] * len(blocks)
            self._outputs.append(kept)
        saved = [vars(block).get("forward") for block in blocks[:first]]
        for i in range(first):
            blocks[i].forward = _passthrough if i < first - 1 else _returning(kept[i])
        hooks = [blocks[i].register_forward_hook(_keeper(kept, i)) for i in range(first, len(blocks))]
        try:
            logits = self.logits(ids)
        finally:
            for h in hooks:
                h.remove()
            for block, forward in zip(blocks, saved, strict=False):
                del block.forward
                if forward is not None:
                    block.forward = forward
        self.blocks_run += len(blocks) - first
        self.blocks_total += len(blocks)
        return logits


def _returning(output: torch.Tensor):
    """A block forward that returns ``output`` (kept on the host) on its input's device."""

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return output.to(hidden.device, copy=True)  # a copy: the model may add to it in place

    return forward


def _keeper(kept: list, index: int):
    def hook(module, args, output):
        kept[index] = (output[0] if isinstance(output, tuple) else output).detach().to("cpu", copy=True)

    return hook
