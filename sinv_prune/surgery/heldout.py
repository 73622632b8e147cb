"""The loss of a model on the held-out calibration tokens, to choose between compensated and plain pruning.

Causal LMs: mean next-token cross-entropy over the held-out tokens (the calibration loss).
Other models (encoders, classifiers): the relative error of the last block's output against the
unpruned model's, recorded when the :class:`HeldOutLoss` is made. Held-out sequences run one at a
time, so at most one sequence's logits are alive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from sinv_prune.arch import HeadAdapter
from sinv_prune.surgery.block_inputs import BlockInput, preserve_modes

_CAUSAL = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm(model: nn.Module) -> bool:
    return any(cls.__name__ in _CAUSAL for cls in type(model).__mro__)


class HeldOutLoss:
    """Measure a model (as it is now) on the held-out tokens of ``inputs``; made on the unpruned model.

    ``unpruned`` is the unpruned model's value (the cross-entropy, or 0 for the last-block error).
    ``kind`` says which: ``"cross-entropy"`` or ``"last-block error"``.
    """

    def __init__(self, model: nn.Module, adapter: HeadAdapter, inputs: list[BlockInput]):
        self.model, self.last = model, adapter.layers()[-1]
        self.causal = is_causal_lm(model)
        self.kind = "cross-entropy" if self.causal else "last-block error"
        self.rows = [(i, r) for i in inputs if i.positions is not None for r in range(i.positions.shape[0])]
        self.rows = [(i, r) for i, r in self.rows if i.positions[r].any()]
        self.reference = None if self.causal else [self._last_output(i, r) for i, r in self.rows]
        self.unpruned = self() if self.causal else 0.0

    def __bool__(self) -> bool:
        return bool(self.rows)

    def __call__(self) -> float:
        if self.causal:
            total, count = 0.0, 0
            for inp, r in self.rows:
                loss, n = self._cross_entropy(inp, r)
                total, count = total + loss, count + n
            return total / max(count, 1)
        err = sum(
            float((self._last_output(i, r) - ref).square().sum())
            for (i, r), ref in zip(self.rows, self.reference, strict=True)
        )
        norm = sum(float(ref.square().sum()) for ref in self.reference)
        return (err / max(norm, 1e-30)) ** 0.5

    def _feed(self, inp: BlockInput, r: int) -> dict:
        return {k: v[r : r + 1] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v for k, v in inp.feed.items()}

    def _mask(self, inp: BlockInput, r: int) -> torch.Tensor:
        keep = inp.positions[r]
        mask = inp.feed.get("attention_mask")
        return keep if mask is None else keep & mask[r].bool()

    def _cross_entropy(self, inp: BlockInput, r: int) -> tuple[float, int]:
        feed = self._feed(inp, r)
        with preserve_modes(self.model), torch.no_grad():
            logits = self.model(**feed, use_cache=False).logits[0, :-1]
        ids = feed["input_ids"][0, 1:]
        keep = self._mask(inp, r)[:-1]
        mask = feed.get("attention_mask")
        if mask is not None:
            keep = keep & mask[0, 1:].bool()
        if not keep.any():
            return 0.0, 0
        loss = F.cross_entropy(logits[keep].float(), ids[keep], reduction="sum")
        return float(loss), int(keep.sum())

    def _last_output(self, inp: BlockInput, r: int) -> torch.Tensor:
        seen = []

        def hook(module, args, output):
            seen.append(output[0] if isinstance(output, tuple) else output)

        handle = self.last.register_forward_hook(hook)
        try:
            with preserve_modes(self.model), torch.no_grad():
                self.model(**self._feed(inp, r))
        finally:
            handle.remove()
        return seen[0][0][self._mask(inp, r)].double()
