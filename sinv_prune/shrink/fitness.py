"""A candidate plan applied without surgery, and its fitness: KL to the unpruned model on held-out tokens.

Removing heads or channels is exactly dropping their columns of the consumer's input (``o_proj``, the
down projection), so a candidate gives, per layer, the consumer a ``forward`` that computes its refitted
kept columns on the kept inputs (what the sliced model computes there); a dropped block's ``forward``
returns its input; a removed expert's gate is 0 (:func:`~sinv_prune.units.experts.gates.expert_gates`: its
router logit ``-inf``, the router routing again as the family does, which is exactly what the sliced
router computes). No weight is written, so blocks that accelerate's hooks offload (their weights
brought in from a weights map for each forward) are candidates as well, and going from one candidate to
the next changes only the layers that differ. :class:`Candidates` is a context manager: on exit every
consumer and block gets its own ``forward`` back and every router its own output.

The fitness forward starts where the candidate first differs from the one measured before it: every
block's output over the fitness batches is kept on the host for the last candidate measured (at first
the unpruned model), and the blocks before the first layer whose cut differs return those outputs
instead of computing (the model's own forward still runs the embeddings, the later blocks and the head).
A child of the search differs from the candidate before it in a few layers, so on average about half the
blocks run. Kept: ``layers x fitness tokens x hidden`` in the model's dtype, in host memory, or, where the
picks keep their refits on disk (:attr:`~sinv_prune.shrink.statistics.Picks.on_disk`), in a disk
:class:`~sinv_prune.surgery.store.Store`; the refitted consumers then read their weights from the picks' disk
store at each forward, so nothing the candidates hold grows with depth in host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.scoring.consumer_statistics import consumer_modules
from sinv_prune.shrink.space import Genome
from sinv_prune.shrink.statistics import Picks
from sinv_prune.surgery.block_inputs import input_device, preserve_modes
from sinv_prune.surgery.store import Store
from sinv_prune.units.experts.gates import expert_gates
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
        self._forwards: dict[int, object] = {}  # id(module) -> its own instance ``forward`` (None: the class's)
        self._applied: dict[tuple[str, int], tuple] = {}
        self._dropped: set[int] = set()
        self.reference: list[torch.Tensor] = []
        self._anchor: list[tuple] = []  # per layer the cut of the candidate whose block outputs are kept
        #: that candidate's block outputs by (batch, layer): host memory, or a disk store
        self._outputs = _Outputs(Store("disk") if picks.on_disk else None)
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
            self.reference, self._anchor = [], []
            self._outputs.close()
            self._modes.__exit__(*exc)

    def reset(self) -> None:
        """The unpruned model again: original parameters, every block's own forward."""
        for key in list(self._applied):
            self._restore(key)
        for layer in list(self._dropped):
            self._unpatch(self.adapter.layers()[layer])
        self._dropped.clear()
        for gate in self._gates:
            gate.fill_(1.0)

    def _restore(self, key) -> None:
        self._unpatch(self._modules[key])
        self._applied.pop(key, None)

    def _patch(self, module: nn.Module, forward) -> None:
        """Give ``module`` ``forward``, remembering its own (accelerate's hook wrapper, where it has one)."""
        if id(module) not in self._forwards:
            self._forwards[id(module)] = vars(module).get("forward")
        module.forward = forward

    def _unpatch(self, module: nn.Module) -> None:
        if id(module) not in self._forwards:
            return
        own = self._forwards.pop(id(module))
        del module.forward
        if own is not None:
            module.forward = own

    def apply(self, genome: Genome) -> None:
        """Make the model compute as ``genome``'s plan would (up to the refits being per-layer)."""
        blocks = self.adapter.layers()
        for layer in range(len(blocks)):
            drop = layer in genome.dropped
            if drop and layer not in self._dropped:
                self._patch(blocks[layer], _passthrough)
                self._dropped.add(layer)
            elif not drop and layer in self._dropped:
                self._unpatch(blocks[layer])
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
        refit = self.picks.refit(key[0], key[1], removed)
        if self.picks.on_disk:  # read again for each forward, from the picks' disk store
            refit = functools.partial(self.picks.refit, key[0], key[1], tuple(removed))
        self._patch(self._modules[key], _kept_linear(refit))
        self._applied[key] = state

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
        kept = self._outputs
        first = first if batch in kept.batches else 0
        kept.batches.add(batch)
        saved = [vars(block).get("forward") for block in blocks[:first]]
        for i in range(first):
            blocks[i].forward = _passthrough if i < first - 1 else _returning(kept.get(batch, i))
        hooks = [blocks[i].register_forward_hook(_keeper(kept, batch, i)) for i in range(first, len(blocks))]
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


def _kept_linear(refit):
    """A consumer forward over the ``kept`` input columns only, with ``[out, kept]`` ``weight``: ``refit`` is
    ``(kept, weight, bias)``, or a function giving it at each call; moved to the input's device for each call
    where they live elsewhere, as an offloaded block's weights would."""

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        kept, weight, bias = refit() if callable(refit) else refit
        device = x.device
        b = None if bias is None else bias.to(device, x.dtype)
        return F.linear(x.index_select(-1, kept.to(device)), weight.to(device, x.dtype), b)

    return forward


def _returning(output: torch.Tensor):
    """A block forward that returns ``output`` (kept on the host) on its input's device."""

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return output.to(hidden.device, copy=True)  # a copy: the model may add to it in place

    return forward


def _keeper(kept: _Outputs, batch: int, index: int):
    def hook(module, args, output):
        kept.put(batch, index, output[0] if isinstance(output, tuple) else output)

    return hook


class _Outputs:
    """The kept block outputs by ``(batch, layer)``: in host memory, or in a disk :class:`Store`."""

    def __init__(self, store: Store | None):
        self.store = store
        self.held: dict[tuple[int, int], torch.Tensor] = {}
        self.batches: set[int] = set()  # the batches whose every block output is kept

    def put(self, batch: int, layer: int, output: torch.Tensor) -> None:
        if self.store is None:
            self.held[batch, layer] = output.detach().to("cpu", copy=True)
        else:
            self.store.put((batch, layer), {"output": output})

    def get(self, batch: int, layer: int) -> torch.Tensor:
        return self.held[batch, layer] if self.store is None else self.store.get((batch, layer))["output"]

    def close(self) -> None:
        self.held.clear()
        self.batches.clear()
        if self.store is not None:
            self.store.close()
