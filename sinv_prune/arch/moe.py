"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GPT-OSS): LLaMA-style attention, and
MoE blocks whose experts are stored fused (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
``[E, H, I]``) behind a softmax top-k router ``gate`` (``weight`` ``[E, H]``). GPT-OSS differs in the
layout (see :class:`GptOssAdapter`); the criteria read experts only through the adapter
(``expert_weights``, ``expert_mlp``, ``expert_output``), never through the fused tensors.

A MoE layer has no dense MLP channels: its ``intermediate_size`` is 0; the ``mlp`` unit prunes the channels
inside its experts instead (``slice_expert_channels``, ``slice_shared_channels``), and its experts are the
``experts`` unit's items. Qwen2/3-MoE may mix dense layers in
(``mlp_only_layers``, ``decoder_sparse_step``); those prune like LLaMA MLPs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from sinv_prune.arch.base import _replace, select_in, select_out
from sinv_prune.arch.llama import LlamaAdapter
from sinv_prune.arch.registry import register_adapter


class MoeAdapter(LlamaAdapter):
    """LLaMA-style attention plus fused experts; subclasses name their config keys."""

    name = "moe"
    model_types = ()
    #: Config attribute holding the expert count (read by the experts, the router and the aux loss).
    config_experts_key: ClassVar[str] = "num_experts"
    #: Config attribute holding one expert's width (Mixtral / OLMoE: intermediate_size; they have no dense layers).
    config_expert_width_key: ClassVar[str] = "moe_intermediate_size"
    #: Config attribute holding the shared expert's width (Qwen2-MoE), None where MoE layers have none.
    config_shared_width_key: ClassVar[str | None] = None
    #: Whether the router casts its top-k weights to the logits' dtype (Qwen2/3-MoE, OLMoE); Mixtral's stay float32.
    weights_in_logits_dtype: ClassVar[bool] = True

    def moe_block(self, layer: int) -> nn.Module | None:
        mlp = self.base.layers[layer].mlp
        return mlp if hasattr(mlp, "experts") and hasattr(mlp, "gate") else None

    def experts(self, layer: int) -> nn.Module:
        return self._moe(layer).experts

    def router(self, layer: int) -> nn.Module:
        return self._moe(layer).gate

    def num_experts(self, layer: int) -> int:
        block = self.moe_block(layer)
        return 0 if block is None else block.experts.gate_up_proj.shape[0]

    def top_k(self) -> int:
        return self.model.config.num_experts_per_tok

    def expert_width(self, layer: int) -> int:
        return self.expert_weights(layer)[2].shape[-1]

    def expert_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every expert's ``(W_gate, W_up, W_down)`` as ``[out, in]`` views (``[E, I, H]``, ``[E, I, H]``,
        ``[E, H, I]``); biases, where a family has them, are not part of these."""
        experts = self.experts(layer)
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        return gate, up, experts.down_proj

    def shared_expert(self, layer: int) -> nn.Module | None:
        """The always-on shared expert of a MoE layer (Qwen2-MoE: gate / up / down ``nn.Linear``), or None."""
        block = self.moe_block(layer)
        return None if block is None else getattr(block, "shared_expert", None)

    def shared_width(self, layer: int) -> int:
        """The shared expert's intermediate width (0: none)."""
        shared = self.shared_expert(layer)
        return 0 if shared is None else shared.down_proj.in_features

    def slice_expert_channels(self, layer: int, keep: torch.Tensor) -> None:
        """Keep channels ``keep[e]`` (``[experts, k]``, ascending per row) of every routed expert ``e``: its
        gate and up rows of ``gate_up_proj`` and the same columns of ``down_proj``."""
        experts = self.experts(layer)
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        keep = keep.to(gate_up.device)
        width, count = down.shape[-1], keep.shape[1]
        rows = torch.cat([keep, keep + width], dim=1)  # gate rows, then the same channels' up rows
        _replace(experts, "gate_up_proj", gate_up.gather(1, rows[:, :, None].expand(-1, -1, gate_up.shape[2])))
        _replace(experts, "down_proj", down.gather(2, keep[:, None, :].expand(-1, down.shape[1], -1)))
        if hasattr(experts, "intermediate_dim"):
            experts.intermediate_dim = count

    def slice_shared_channels(self, layer: int, keep: torch.Tensor) -> None:
        """Keep channels ``keep`` (ascending) of the shared expert: gate / up rows, down columns."""
        shared = self.shared_expert(layer)
        for module in (shared.gate_proj, shared.up_proj):
            select_out(module, keep)
        select_in(shared.down_proj, keep)
        if hasattr(shared, "intermediate_size"):
            shared.intermediate_size = keep.numel()

    def expert_mlp(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One expert's ``(W_gate, W_up, W_down)`` as ``[out, in]`` views (``[I, H]``, ``[I, H]``, ``[H, I]``)."""
        return tuple(w[expert] for w in self.expert_weights(layer))

    def expert_output(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """What expert ``expert`` of ``layer`` returns for tokens ``x`` ``[n, H]`` before the router's weight,
        computed in ``x``'s dtype: ``W_down (act(W_gate x) * W_up x)``."""
        experts = self.experts(layer)
        gate_up = experts.gate_up_proj[expert].detach().to(x.dtype)
        gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert].detach().to(x.dtype))

    def slice_experts(self, layer: int, keep: torch.Tensor) -> None:
        """Keep only experts ``keep`` (ascending) of ``layer``: fused weights, router rows (and bias), counts."""
        experts, router, count = self.experts(layer), self.router(layer), self.num_experts(layer)
        for module in (experts, router):
            for name, param in list(module.named_parameters(recurse=False)):
                if param.shape and param.shape[0] == count:
                    _replace(module, name, param.detach().index_select(0, keep.to(param.device)))
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None and buffer.shape and buffer.shape[0] == count:
                    persistent = name not in module._non_persistent_buffers_set
                    module.register_buffer(name, buffer.index_select(0, keep.to(buffer.device)), persistent=persistent)
            if hasattr(module, "num_experts"):
                module.num_experts = keep.numel()

    def route(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's ``(top-k weights, top-k experts)`` from its logits, as the family computes them: softmax
        and top-k in float32, the weights cast back to the logits' dtype where the family does
        (:attr:`weights_in_logits_dtype`)."""
        router = self.router(layer)
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if self.renormalizes(router):
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if self.weights_in_logits_dtype else top), index

    def renormalizes(self, router: nn.Module) -> bool:
        """Whether the top-k weights are renormalised to sum to 1 (``norm_topk_prob``)."""
        return bool(getattr(router, "norm_topk_prob", False))

    def expert_modules(self, layer: int) -> list[nn.Module]:
        """The modules ``slice_experts`` changes."""
        return [self.experts(layer), self.router(layer)]

    # -- a MoE layer has no dense MLP channels --------------------------------------------

    def intermediate_size(self, layer):
        return 0 if self.moe_block(layer) is not None else super().intermediate_size(layer)

    def mlp(self, layer):
        return () if self.moe_block(layer) is not None else super().mlp(layer)

    def mlp_in(self, layer):
        return [] if self.moe_block(layer) is not None else super().mlp_in(layer)

    def mlp_out(self, layer):
        if self.moe_block(layer) is not None:
            raise ValueError(f"layer {layer} is a mixture-of-experts layer: it has experts, not dense MLP channels")
        return super().mlp_out(layer)

    def mlp_modules(self, layer):
        block = self.moe_block(layer)
        return [block] if block is not None else super().mlp_modules(layer)

    def _moe(self, layer: int) -> nn.Module:
        block = self.moe_block(layer)
        if block is None:
            raise ValueError(f"layer {layer} is a dense layer: it has no experts")
        return block


@register_adapter
class Qwen3MoeAdapter(MoeAdapter):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), experts with an optional renormalised top-k."""

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)


@register_adapter
class Qwen2MoeAdapter(MoeAdapter):
    """Qwen2-MoE: Qwen2 attention (q/k/v biases); MoE layers add a shared expert behind a sigmoid gate, which
    expert pruning leaves alone (the ``mlp`` unit prunes its channels)."""

    name = "qwen2_moe"
    model_types = ("qwen2_moe",)
    config_shared_width_key = "shared_expert_intermediate_size"


@register_adapter
class MixtralAdapter(MoeAdapter):
    """Mixtral: Mistral attention; every layer is MoE, top-k weights always renormalised."""

    name = "mixtral"
    model_types = ("mixtral",)
    config_experts_key = "num_local_experts"
    config_expert_width_key = "intermediate_size"
    weights_in_logits_dtype = False

    def renormalizes(self, router):
        return True


@register_adapter
class OlmoeAdapter(MoeAdapter):
    """OLMoE: every layer is MoE; its q/k norms span all heads at once, so heads cannot be removed exactly."""

    name = "olmoe"
    model_types = ("olmoe",)
    config_expert_width_key = "intermediate_size"
    heads_refusal = (
        "OLMoE's q_norm and k_norm normalise all heads of a layer together, so removing a head changes the "
        "kept ones; prune experts, MLP layers or whole layers instead"
    )


@register_adapter
class GptOssAdapter(MoeAdapter):
    """GPT-OSS: attention with q/k/v/o biases and one learned sink logit per query head (``self_attn.sinks``
    ``[heads]``), sliding and full layers (``layer_types``); every layer is MoE, with a router ``mlp.router``
    (``weight`` ``[E, H]`` and ``bias`` ``[E]``) that takes the top-k logits and softmaxes over those k only.

    Experts are stored transposed, gate and up interleaved, with biases: ``gate_up_proj`` ``[E, H, 2I]``
    (gate = columns ``0, 2, 4, ...``, up = columns ``1, 3, 5, ...``), ``gate_up_proj_bias`` ``[E, 2I]``,
    ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``; with ``gate, up`` the even and odd
    entries of ``x gate_up_proj + gate_up_proj_bias``, an expert computes
    ``((clamp(up, -l, l) + 1) * g * sigmoid(alpha g)) down_proj + down_proj_bias``, ``g = min(gate, l)``
    (``l`` = ``swiglu_limit``, ``alpha`` = ``swiglu_alpha``). ``expert_weights`` returns the
    de-interleaved ``[out, in]`` views (``W_gate`` from the even columns, ``W_up`` from the odd ones,
    ``W_down`` = ``down_proj^T``), biases left out; ``W_down W_up`` is the expert's linear path through
    ``up``, as it is for the other families (what ``magnitude`` and ``sinv_static`` read).
    ``expert_output`` runs the experts module's own gate function (``_apply_gate``) with the biases
    (what ``reap`` and ``ean`` read).

    Exactness: removing experts equals giving their logits ``-inf`` (top-k never picks them, and the
    softmax runs over the chosen k); removing heads slices their sinks with them (each head's softmax has
    its own sink logit, so a kept head computes what it computed before).
    """

    name = "gpt_oss"
    model_types = ("gpt_oss",)
    config_experts_key = "num_local_experts"
    config_expert_width_key = "intermediate_size"
    routing = "top-k of the logits, softmax over the k"

    def moe_block(self, layer: int) -> nn.Module | None:
        mlp = self.base.layers[layer].mlp
        return mlp if hasattr(mlp, "experts") and hasattr(mlp, "router") else None

    def router(self, layer: int) -> nn.Module:
        return self._moe(layer).router

    def expert_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """De-interleaved ``[out, in]`` views: ``W_gate`` ``gate_up_proj[:, :, 0::2]^T``, ``W_up``
        ``gate_up_proj[:, :, 1::2]^T`` (``[E, I, H]``), ``W_down`` ``down_proj^T`` (``[E, H, I]``)."""
        experts = self.experts(layer)
        gate_up = experts.gate_up_proj
        return gate_up[..., 0::2].mT, gate_up[..., 1::2].mT, experts.down_proj.mT

    def expert_output(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """The expert's output for tokens ``x`` ``[n, H]`` as ``GptOssExperts.forward`` computes it (biases,
        the module's clamped SwiGLU), before the router's weight, in ``x``'s dtype."""
        experts = self.experts(layer)
        w = {name: getattr(experts, name)[expert].detach().to(x.dtype) for name in _GPT_OSS_EXPERT_PARAMS}
        gate_up = x @ w["gate_up_proj"] + w["gate_up_proj_bias"]
        return experts._apply_gate(gate_up) @ w["down_proj"] + w["down_proj_bias"]

    def route(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``GptOssTopKRouter``: the top-k logits, then a softmax over those k (in the logits' dtype)."""
        top, index = torch.topk(logits, self.router(layer).top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), index

    def renormalizes(self, router: nn.Module) -> bool:
        return True  # the softmax over the top k is the full softmax's top k renormalised

    def slice_expert_channels(self, layer: int, keep: torch.Tensor) -> None:
        """Keep channels ``keep[e]`` (``[experts, k]``) of every expert: its interleaved gate and up columns
        ``2c, 2c + 1`` of ``gate_up_proj`` and ``gate_up_proj_bias``, rows ``c`` of ``down_proj`` (whose
        bias, added after the channels, stays)."""
        experts = self.experts(layer)
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, H, 2I], [E, I, H]
        keep = keep.to(gate_up.device)
        columns = torch.stack([2 * keep, 2 * keep + 1], dim=2).flatten(1)  # [E, 2k]: gate, up, gate, up, ...
        _replace(experts, "gate_up_proj", gate_up.gather(2, columns[:, None, :].expand(-1, gate_up.shape[1], -1)))
        _replace(experts, "gate_up_proj_bias", experts.gate_up_proj_bias.detach().gather(1, columns))
        _replace(experts, "down_proj", down.gather(1, keep[:, :, None].expand(-1, -1, down.shape[2])))
        experts.intermediate_size = keep.shape[1]

    def slice_heads(self, layer, keep_q, keep_kv):
        super().slice_heads(layer, keep_q, keep_kv)
        attn = self.attention(layer)
        _replace(attn, "sinks", attn.sinks.detach().index_select(0, keep_q.to(attn.sinks.device)))


_GPT_OSS_EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
