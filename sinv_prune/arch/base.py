"""The contract every attention-layout adapter fulfils.

An adapter knows, for one model family, where each layer's Q, K, V and O weights
live, how to read them per head and how to slice them. Everything else
(validation, bookkeeping, checkpoints, measures, criteria) is written once
against this interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.pytorch_utils import Conv1D


@dataclass(frozen=True)
class HeadLayout:
    """Current head geometry of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads served by each KV head (1 without GQA, 0 for an empty layer)."""
        return self.num_heads // self.num_kv_heads if self.num_kv_heads else 0


@dataclass
class Projections:
    """One layer's attention weights in ``nn.Linear`` orientation (``[out, in]``).

    ``q``: ``[H*d, D]``, ``k`` and ``v``: ``[KV*d, D]``, ``o``: ``[D, H*d]``.
    These are views of the live parameters (transposed for ``Conv1D``).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Row indices of the given heads in a ``[heads*head_dim, ...]`` projection."""
    offsets = torch.arange(head_dim, device=heads.device)
    return (heads[:, None] * head_dim + offsets).reshape(-1)


def select_out(module: nn.Module, index: torch.Tensor) -> None:
    """Keep only the output features ``index`` of a Linear or Conv1D, in place (on the weight's own device)."""
    dim = 1 if isinstance(module, Conv1D) else 0
    index = index.to(module.weight.device)
    _replace(module, "weight", module.weight.detach().index_select(dim, index))
    if getattr(module, "bias", None) is not None:
        _replace(module, "bias", module.bias.detach().index_select(0, index))
    if isinstance(module, Conv1D):
        module.nf = index.numel()
    else:
        module.out_features = index.numel()


def select_in(module: nn.Module, index: torch.Tensor) -> None:
    """Keep only the input features ``index`` of a Linear or Conv1D, in place (on the weight's own device)."""
    dim = 0 if isinstance(module, Conv1D) else 1
    index = index.to(module.weight.device)
    _replace(module, "weight", module.weight.detach().index_select(dim, index))
    if isinstance(module, Conv1D):
        module.nx = index.numel()
    else:
        module.in_features = index.numel()


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def linear_weight(module: nn.Module) -> torch.Tensor:
    """A Linear or Conv1D weight as ``[out, in]``."""
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


class HeadAdapter:
    """Base class of the architecture adapters; one subclass per attention layout.

    Subclasses set ``model_types`` (the ``config.model_type`` values they serve)
    and implement the abstract methods below. Register them with
    :func:`sinv_prune.arch.register_adapter`.
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    #: Config attributes holding the original head counts (query, key/value or None).
    config_heads_key: ClassVar[str] = "num_attention_heads"
    config_kv_heads_key: ClassVar[str | None] = None
    #: Config attribute holding the MLP width (GPT-2: ``n_inner``, where None means 4 x ``n_embd``).
    config_intermediate_key: ClassVar[str] = "intermediate_size"

    def __init__(self, model: nn.Module):
        self.model = model
        self.base = model.base_model

    # -- per architecture -------------------------------------------------
    def layers(self) -> list[nn.Module]:
        """The transformer blocks, in order."""
        return list(self.layer_stack())

    def layer_stack(self) -> nn.ModuleList:
        """The ``nn.ModuleList`` holding the transformer blocks (what layer removal edits)."""
        raise NotImplementedError

    def attention(self, layer: int) -> nn.Module:
        """The module whose forward computes the heads of ``layer``."""
        raise NotImplementedError

    def out_proj(self, layer: int) -> nn.Module:
        """The output projection; its input is the concatenation of the heads."""
        raise NotImplementedError

    def layout(self, layer: int) -> HeadLayout:
        raise NotImplementedError

    def projections(self, layer: int) -> Projections:
        raise NotImplementedError

    def mlp(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The MLP's linear path, ``[out, in]`` weights applied in order (input side first).

        Gated MLPs return ``(W_up, W_down)``: the gate multiplies, it is not on the linear path.
        """
        raise NotImplementedError

    def mlp_in(self, layer: int) -> list[nn.Module]:
        """The MLP modules whose output features are the intermediate channels (gate and up for gated MLPs)."""
        raise NotImplementedError

    def mlp_out(self, layer: int) -> nn.Module:
        """The MLP's down projection; its input features are the intermediate channels."""
        raise NotImplementedError

    def intermediate_size(self, layer: int) -> int:
        """Current number of MLP channels of ``layer``."""
        return linear_weight(self.mlp_out(layer)).shape[1]

    def slice_mlp(self, layer: int, keep: torch.Tensor) -> None:
        """Physically keep only the MLP channels ``keep`` (rows of every ``mlp_in`` module, columns of ``mlp_out``)."""
        for module in self.mlp_in(layer):
            select_out(module, keep)
        select_in(self.mlp_out(layer), keep)

    def mlp_modules(self, layer: int) -> list[nn.Module]:
        """The modules ``slice_mlp`` changes."""
        return [*self.mlp_in(layer), self.mlp_out(layer)]

    # -- mixture of experts (the MoE adapters override; a dense model has none) ---------------
    #: Why heads cannot be removed exactly from this family (None: they can).
    heads_refusal: ClassVar[str | None] = None
    #: Config attribute holding the expert count (None: the family has no experts).
    config_experts_key: ClassVar[str | None] = None

    def moe_block(self, layer: int) -> nn.Module | None:
        """The layer's mixture-of-experts block, or None for a dense layer."""
        return None

    def num_experts(self, layer: int) -> int:
        """Current number of routed experts of ``layer`` (0 for a dense layer)."""
        return 0

    def expert_counts(self) -> list[int]:
        """The routed-expert count of every mixture-of-experts layer, in order (empty for a dense model)."""
        return [n for n in (self.num_experts(i) for i in range(self.num_layers)) if n]

    def attention_residual_norm(self, layer: int) -> nn.Module | None:
        """The pre-norm whose input is the residual stream ``layer``'s attention output is added to, or None
        where the block is not laid out so (post-norm blocks, a norm between the sub-block and the addition)."""
        return None

    def mlp_residual_norm(self, layer: int) -> nn.Module | None:
        """As :meth:`attention_residual_norm`, for the MLP's output (None on mixture-of-experts layers too)."""
        return None

    def residual_norms(self) -> bool:
        """Whether any block has a residual norm (``target="residual"`` compensation applies somewhere)."""
        return any(self.attention_residual_norm(i) or self.mlp_residual_norm(i) for i in range(self.num_layers))

    def slice_heads(self, layer: int, keep_q: torch.Tensor, keep_kv: torch.Tensor) -> None:
        """Physically keep only query heads ``keep_q`` and KV heads ``keep_kv``."""
        raise NotImplementedError

    def empty_forward(self, layer: int):
        """A forward for an attention module whose every head was removed."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------
    def touched_modules(self, layer: int) -> list[nn.Module]:
        """The modules (with their submodules) that ``slice_heads`` and ``empty_forward`` change.

        :func:`~sinv_prune.prune_heads` checks their weights before slicing and restores
        them if slicing fails; override when an adapter changes anything else.
        """
        return [self.attention(layer), self.out_proj(layer)]

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def config_intermediate_size(self, config) -> int:
        """The MLP width a config builds."""
        return getattr(config, self.config_intermediate_key)

    def original_head_counts(self, config) -> tuple[int, int]:
        heads = getattr(config, self.config_heads_key)
        kv = getattr(config, self.config_kv_heads_key, None) if self.config_kv_heads_key else None
        return heads, kv or heads


#: Keyword names under which transformers hands an attention forward its KV cache: ``cache``
#: (5.24), ``past_key_values`` (5.0 to 5.23), ``past_key_value`` and ``layer_past`` (4.x).
CACHE_ARG_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


def pop_cache(args: tuple, kwargs: dict) -> Cache | None:
    """The KV cache passed to an attention forward, under any known name or positionally.

    Every known cache keyword is removed from ``kwargs``; a positional argument counts
    when it is a :class:`~transformers.cache_utils.Cache`.
    """
    found = [kwargs.pop(name) for name in CACHE_ARG_NAMES if name in kwargs]
    found += [a for a in args if isinstance(a, Cache)]
    return next((c for c in found if c is not None), None)


def empty_cache_update(layer_idx: int, hidden_states: torch.Tensor, head_dim: int, args: tuple, kwargs: dict) -> None:
    """Advance the KV cache given to an empty attention forward so sequence lengths stay right."""
    cache = pop_cache(args, kwargs)
    if cache is None:
        return
    if hasattr(cache, "self_attention_cache"):
        cache = cache.self_attention_cache
    batch, seq = hidden_states.shape[:2]
    # One all-zero placeholder head, never read: a cache layer holding zero elements reports a
    # sequence length of 0 (DynamicLayer.get_seq_length), which breaks positions and masks when
    # the empty layer is layer 0, the one generate() asks for the cached length.
    empty = hidden_states.new_zeros(batch, 1, seq, head_dim)
    # transformers 5.0 to 5.3 take a positional dict of cache kwargs (a StaticCache reads
    # cache_position there); later versions accept and ignore extra positional arguments.
    cache.update(empty, empty, layer_idx, {"cache_position": kwargs.get("cache_position")})
