"""Statistics of an unpruned model's consumers, in one pass over calibration sequences.

Per layer, the normal equations of the attention output projection and of the MLP down projection
against their own unpruned outputs (:class:`~sinv_prune.surgery.refit.ConsumerFit`; fit and held-out
sequences apart), from which OBS orders and refits of any cut follow without another pass, and each
block's influence (ShortGPT: ``1 - cos(input, output)``). The pass stops after the last block. A
mixture-of-experts layer has no dense down projection; its routed experts are scored instead, by REAP
(:class:`~sinv_prune.scoring.criteria.routing.ReapCriterion`) on the fit sequences, in a second pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.progress import bar
from sinv_prune.surgery.block_inputs import Stop, input_device, rows
from sinv_prune.surgery.refit import ConsumerFit, consumer_weights
from sinv_prune.units.heads import HEADS
from sinv_prune.units.mlp import MLP


def consumer_modules(adapter: HeadAdapter) -> dict[tuple[str, int], nn.Module]:
    """Every layer's refitted consumers: ``o_proj`` (heads) and, in a dense layer, the down projection (MLP)."""
    n = adapter.num_layers
    out = {(HEADS.name, i): adapter.out_proj(i) for i in range(n)}
    return out | {(MLP.name, i): adapter.mlp_out(i) for i in range(n) if not adapter.num_experts(i)}


class Statistics:
    """Per layer the fit / held-out :class:`ConsumerFit` of ``o_proj`` and the down projection; block influence."""

    def __init__(self, model: nn.Module, adapter: HeadAdapter, sequences: Sequence[torch.Tensor],
                 heldout: Sequence[bool], *, batch: int = 4, quiet: bool = False):  # fmt: skip
        n = adapter.num_layers
        self.fits: dict[tuple[str, int], tuple[ConsumerFit, ConsumerFit]] = {}
        self.influence = [0.0] * n
        counts = [0] * n
        consumers = consumer_modules(adapter)
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
        #: Per layer the routed experts' REAP scores (higher: more useful), ``[]`` for a dense layer.
        self.expert_scores: list[list[float]] = [[] for _ in range(n)]
        if adapter.expert_counts():
            self.expert_scores = _reap(model, [ids for ids, held in groups if not held] or [groups[0][0]], quiet)

    def bypass_order(self) -> list[int]:
        """Layers from the one that changes its input least (cheapest to drop) to the most."""
        return sorted(range(len(self.influence)), key=lambda i: self.influence[i])


def _reap(model: nn.Module, batches: list[torch.Tensor], quiet: bool) -> list[list[float]]:
    from sinv_prune.scoring.criteria.routing import ReapCriterion

    criterion = ReapCriterion()
    for ids in bar(batches, desc="expert scores (REAP)", unit="batch", disable=quiet):
        criterion.update(model, {"input_ids": ids})
    return criterion.scores(model)


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
