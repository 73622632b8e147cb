"""What the search needs from the unpruned model, measured once: consumers' statistics, OBS orders, refits.

One pass over the calibration sequences (stopped after the last block) accumulates, per layer, the
normal equations of the attention output projection and of the MLP down projection against their
own unpruned outputs (:class:`~sinv_prune.surgery.refit.ConsumerFit`; fit and held-out sequences
apart) and each block's influence (ShortGPT: ``1 - cos(input, output)``). From them, per layer:

* heads: for every :class:`~sinv_prune.shrink.space.HeadOption`, which KV groups go (group OBS, a unit
  is a whole group's ``o_proj`` columns), then which query heads in each kept group (OBS with equal
  quotas per group);
* MLP channels: one greedy OBS pass, ``multiple`` channels a step (:func:`~sinv_prune.surgery.obs.obs_channel_order`),
  whose prefixes are every width's removal;
* the refit of the kept columns (ridge walked on the held-out statistics, plain weights kept where the
  refit does not generalise: :func:`~sinv_prune.surgery.compensation.guarded_refit`), cached.

Every layer is fitted on the unpruned model's inputs (not sequentially), so a candidate costs a few
small solves and one forward; the chosen plan can be rebuilt sequentially afterwards.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.arch.base import head_rows
from sinv_prune.progress import bar
from sinv_prune.shrink.space import HeadOption, Space
from sinv_prune.surgery.block_inputs import Stop, input_device, rows
from sinv_prune.surgery.compensation import guarded_refit
from sinv_prune.surgery.obs import obs_channel_order, obs_order
from sinv_prune.surgery.refit import ConsumerFit, consumer_weights


class Statistics:
    """Per layer the fit / held-out :class:`ConsumerFit` of ``o_proj`` and the down projection; block influence."""

    def __init__(self, model: nn.Module, adapter: HeadAdapter, sequences: Sequence[torch.Tensor],
                 heldout: Sequence[bool], *, batch: int = 4, quiet: bool = False):  # fmt: skip
        self.adapter = adapter
        n = adapter.num_layers
        self.fits: dict[tuple[str, int], tuple[ConsumerFit, ConsumerFit]] = {}
        self.influence = [0.0] * n
        counts = [0] * n
        consumers = {("heads", i): adapter.out_proj(i) for i in range(n)}
        consumers |= {("mlp", i): adapter.mlp_out(i) for i in range(n)}
        for key, module in consumers.items():
            weight, bias = consumer_weights(module)
            fit, held = (ConsumerFit(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                                     product_dtype=torch.float32) for _ in range(2))  # fmt: skip
            self.fits[key] = (fit, held)
        state = {"held": False}

        def consumer_hook(key):
            def hook(module, args, output):
                fit = self.fits[key][1 if state["held"] else 0]
                fit.update(rows(args[0], None), rows(output, None))

            return hook

        def block_hook(i: int, last: bool):
            def hook(module, args, kwargs, output):
                x = args[0] if args else kwargs["hidden_states"]
                y = output[0] if isinstance(output, tuple | list) else output
                cos = nn.functional.cosine_similarity(x.double(), y.double(), dim=-1)
                self.influence[i] += float((1 - cos).sum())
                counts[i] += cos.numel()
                if last:
                    raise Stop

            return hook

        blocks = adapter.layers()
        device = input_device(model)
        with contextlib.ExitStack() as stack, torch.no_grad():
            for key, module in consumers.items():
                stack.enter_context(_hooked(module.register_forward_hook(consumer_hook(key))))
            for i, block in enumerate(blocks):
                stack.enter_context(_hooked(block.register_forward_hook(block_hook(i, i == n - 1), with_kwargs=True)))
            groups = _batches(sequences, heldout, batch)
            with bar(total=len(sequences), desc="statistics", unit="seq", disable=quiet) as progress:
                for ids, held in groups:
                    state["held"] = held
                    with contextlib.suppress(Stop):
                        model(input_ids=ids.to(device), use_cache=False)
                    progress.update(ids.shape[0])
        self.influence = [v / max(c, 1) for v, c in zip(self.influence, counts, strict=True)]

    def bypass_order(self) -> list[int]:
        """Layers from the one that changes its input least (cheapest to drop) to the most."""
        return sorted(range(len(self.influence)), key=lambda i: self.influence[i])


class Picks:
    """Which units each option removes (OBS on the unpruned statistics) and the refit kept weights, cached."""

    def __init__(self, stats: Statistics, space: Space, *, cache: int = 256, quiet: bool = False):
        self.stats, self.space, self.adapter = stats, space, stats.adapter
        self.mlp_steps: dict[int, list[list[int]]] = {}
        self._heads: dict[tuple[int, int], list[int]] = {}
        self._refits: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = OrderedDict()
        self._cap = cache
        for s in bar(space.layers, desc="OBS orders", unit="layer", disable=quiet):
            if s.max_steps:
                fit = self.stats.fits["mlp", s.layer][0]
                weight, _ = consumer_weights(self.adapter.mlp_out(s.layer))
                width = weight.shape[1]
                self.mlp_steps[s.layer] = obs_channel_order(fit.gram[:width, :width], weight, s.max_steps * s.step,
                                                            s.step)  # fmt: skip

    def heads(self, layer: int, option: int) -> list[int]:
        """Query heads (current numbering) that head option ``option`` of ``layer`` removes."""
        if option == 0:
            return []
        if (layer, option) not in self._heads:
            self._heads[layer, option] = self._choose_heads(layer, self.space.layers[layer].heads[option])
        return self._heads[layer, option]

    def _choose_heads(self, layer: int, option: HeadOption) -> list[int]:
        lay = self.adapter.layout(layer)
        group, d = lay.group_size, lay.head_dim
        fit = self.stats.fits["heads", layer][0]
        weight, _ = consumer_weights(self.adapter.out_proj(layer))
        width = weight.shape[1]
        gram = fit.gram[:width, :width]
        gone_groups: list[int] = []
        if option.groups < lay.num_kv_heads:
            gone_groups = obs_order(gram, weight, group * d, None, lay.num_kv_heads - option.groups)[0]
        kept_groups = [g for g in range(lay.num_kv_heads) if g not in gone_groups]
        removed = [h for g in gone_groups for h in range(g * group, (g + 1) * group)]
        if option.per_group < group:
            kept_heads = [h for g in kept_groups for h in range(g * group, (g + 1) * group)]
            cols = head_rows(torch.tensor(kept_heads, device=gram.device), d)
            sub = gram.index_select(0, cols).index_select(1, cols)
            quotas = [(list(range(j * group, (j + 1) * group)), group - option.per_group)
                      for j in range(len(kept_groups))]  # fmt: skip
            order = obs_order(sub, weight.index_select(1, cols), d, quotas, sum(q for _, q in quotas))[0]
            removed += [kept_heads[u] for u in order]
        return sorted(removed)

    def channels(self, layer: int, steps: int) -> list[int]:
        """MLP channels (current numbering) removed by taking ``steps`` OBS steps in ``layer``."""
        return sorted(c for step in self.mlp_steps.get(layer, [])[:steps] for c in step)

    def refit(self, unit: str, layer: int, removed_units: Sequence[int]) -> tuple:
        """``(kept columns, weight over them, bias)``: the guarded refit of ``layer``'s ``unit`` consumer."""
        key = (unit, layer, tuple(removed_units))
        if key in self._refits:
            self._refits.move_to_end(key)
            return self._refits[key]
        module = self.adapter.out_proj(layer) if unit == "heads" else self.adapter.mlp_out(layer)
        weight, bias = consumer_weights(module)
        width = weight.shape[1]
        if unit == "heads":
            d = self.adapter.layout(layer).head_dim
            gone = set(head_rows(torch.tensor(list(removed_units), dtype=torch.long), d).tolist())
        else:
            gone = set(removed_units)
        kept = torch.tensor([c for c in range(width) if c not in gone], dtype=torch.long, device=weight.device)
        fit, held = (f.restrict(kept) for f in self.stats.fits[unit, layer])
        plain = (weight.index_select(1, kept), bias)
        _, (w, b), _, _ = guarded_refit(fit, held if held.tokens else None, plain)
        value = (kept, w.to(weight.dtype), None if b is None else b.to(weight.dtype))
        self._refits[key] = value
        if len(self._refits) > self._cap:
            self._refits.popitem(last=False)
        return value


def _batches(sequences, heldout, batch: int) -> list[tuple[torch.Tensor, bool]]:
    """Sequences stacked ``batch`` at a time (fit and held-out apart; equal lengths only share a batch)."""
    out = []
    for held in (False, True):
        run: list[torch.Tensor] = []
        for ids in (s for s, h in zip(sequences, heldout, strict=True) if h == held):
            if run and (len(run) == batch or ids.shape != run[0].shape):
                out.append((torch.stack(run), held))
                run = []
            run.append(ids)
        if run:
            out.append((torch.stack(run), held))
    return out


@contextlib.contextmanager
def _hooked(handle):
    try:
        yield handle
    finally:
        handle.remove()
