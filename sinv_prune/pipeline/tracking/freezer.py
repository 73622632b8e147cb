"""Keeping converged heads' Q/K/V/O slices fixed during training."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from sinv_prune.arch import get_adapter

logger = logging.getLogger(__name__)


# -- freezing ---------------------------------------------------------------------------------


class HeadFreezer:
    """Keeps chosen heads' Q, K, V and O slices (weights and biases) fixed during training.

    Two mechanisms together:

    * gradient hooks on the attention parameters zero the frozen rows / columns of each
      gradient, so frozen slices add nothing to gradient norms (clipping) or to optimizer
      moment estimates from the moment they are frozen;
    * :meth:`restore` writes the values saved at freezing time back into the frozen
      slices. Call it after every ``optimizer.step()`` (the callback does, in
      ``on_optimizer_step``; :meth:`attach_optimizer` registers it as an optimizer
      post-step hook for custom loops). Zero gradients alone do not keep a weight fixed:
      AdamW's momentum keeps moving it for a while after its gradient stops, and decoupled
      weight decay shrinks it regardless; restoring makes the freeze exact whatever the
      optimizer.

    Under grouped-query attention a key/value head's slices are frozen only when every
    query head it serves is frozen. The output projection's bias is shared by all heads and
    never frozen. Slices are located through the adapter's ``projections`` views, mapped back
    to storage offsets of the owning parameters, so fused (GPT-2 ``c_attn``) and transposed
    (``Conv1D``) layouts need no special case. Single-device / DDP training only (not
    FSDP / DeepSpeed ZeRO sharded parameters); the model must not be pruned while frozen.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapter = get_adapter(model)
        self.frozen: list[set[int]] = [set() for _ in range(self.adapter.num_layers)]
        self._masks: dict[nn.Parameter, torch.Tensor] = {}  # param -> bool mask of frozen elements
        self._saved: dict[nn.Parameter, torch.Tensor] = {}  # param -> frozen values (mask order)
        self._handles: list = []
        self._hooked: set[int] = set()

    # public -----------------------------------------------------------------
    def freeze(self, layer: int, heads: Iterable[int]) -> list[int]:
        """Freeze query heads ``heads`` of ``layer`` at their current values; returns the newly frozen ones."""
        num = self.adapter.layout(layer).num_heads
        new = sorted({int(h) for h in heads} - self.frozen[layer])
        bad = [h for h in new if not 0 <= h < num]
        if bad:
            raise ValueError(f"layer {layer} has {num} heads; cannot freeze {bad}")
        if new:
            self.frozen[layer].update(new)
            self._rebuild(layer)
        return new

    def freeze_below(self, record: dict, threshold: float, measure: str = "C_Q") -> dict[int, list[int]]:
        """Freeze every head whose ``record[measure]`` is below ``threshold``; returns the newly frozen heads."""
        newly = {}
        for layer, values in enumerate(record[measure]):
            heads = [h for h, v in enumerate(values) if v is not None and v < threshold]
            added = self.freeze(layer, heads) if heads else []
            if added:
                newly[layer] = added
        return newly

    def frozen_heads(self) -> list[list[int]]:
        return [sorted(s) for s in self.frozen]

    @torch.no_grad()
    def restore(self) -> None:
        """Write the saved values back into every frozen slice."""
        for param, mask in self._masks.items():
            param.masked_scatter_(mask, self._saved[param])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Call :meth:`restore` after every ``optimizer.step()``; returns the hook handle."""
        handle = optimizer.register_step_post_hook(lambda *_: self.restore())
        self._handles.append(handle)
        return handle

    def remove(self) -> None:
        """Remove every hook; the heads train normally again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._masks.clear()
        self._saved.clear()
        self.frozen = [set() for _ in range(self.adapter.num_layers)]

    # internals --------------------------------------------------------------
    def _params(self, layer: int) -> list[nn.Parameter]:
        seen, out = set(), []
        for module in (self.adapter.attention(layer), self.adapter.out_proj(layer)):
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _rebuild(self, layer: int) -> None:
        layout = self.adapter.layout(layer)
        d, group = layout.head_dim, layout.group_size
        q_heads = sorted(self.frozen[layer])
        kv_heads = [
            j
            for j in range(layout.num_kv_heads)
            if all(h in self.frozen[layer] for h in range(j * group, (j + 1) * group))
        ]
        proj = self.adapter.projections(layer)
        # (view, dim, heads): rows of q/k/v (and their biases) along dim 0, columns of o along dim 1.
        parts = [
            (proj.q, 0, q_heads),
            (proj.q_bias, 0, q_heads),
            (proj.o, 1, q_heads),
            (proj.k, 0, kv_heads),
            (proj.k_bias, 0, kv_heads),
            (proj.v, 0, kv_heads),
            (proj.v_bias, 0, kv_heads),
        ]
        params = self._params(layer)
        flags: dict[nn.Parameter, torch.Tensor] = {}  # param -> flat bool over its storage
        for view, dim, heads in parts:
            if view is None:
                continue
            param = _owner(view, params)
            if param not in flags:  # flat bool over the storage span of ``param``
                flags[param] = torch.zeros(_extent(param), dtype=torch.bool, device=param.device)
            if heads:
                index = (
                    torch.tensor(heads, device=param.device)[:, None] * d + torch.arange(d, device=param.device)
                ).reshape(-1)
                offset = view.storage_offset() - param.storage_offset()
                marked = torch.as_strided(flags[param], view.shape, view.stride(), offset)
                marked.index_fill_(dim, index, True)
        for param, flat in flags.items():
            mask = torch.as_strided(flat, param.shape, param.stride(), 0).clone()
            if mask.any():
                self._masks[param] = mask
                self._saved[param] = param.detach()[mask].clone()
                if id(param) not in self._hooked and param.requires_grad:
                    self._hooked.add(id(param))
                    self._handles.append(param.register_hook(self._grad_hook(param)))

    def _grad_hook(self, param: nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            mask = self._masks.get(param)
            return None if mask is None else grad.masked_fill(mask, 0)

        return hook


def _extent(t: torch.Tensor) -> int:
    """Number of storage elements spanned by ``t`` from its storage offset on."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)


def _owner(view: torch.Tensor, params: Sequence[nn.Parameter]) -> nn.Parameter:
    """The parameter whose storage span holds the view (views of one parameter share its storage)."""
    ptr, start = view.untyped_storage().data_ptr(), view.storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() == ptr and 0 <= start - p.storage_offset() < _extent(p):
            return p
    raise ValueError("the adapter's projections are not views of the layer's parameters; cannot freeze heads")
