"""llama.cpp's ``qwen3moe``: Qwen3-MoE (per-head q/k norm, every layer MoE, top-k weights renormalised)."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.llama_family import LlamaFamilyArch
from sinv_prune.deploy.archs.moe import ExpertsMixin
from sinv_prune.deploy.archs.registry import register


@register
class Qwen3Moe(ExpertsMixin, LlamaFamilyArch):
    name = "qwen3moe"
    model_arch = gguf.MODEL_ARCH.QWEN3MOE
    families = ("qwen3_moe",)
    optional_biases = frozenset({"attn_q", "attn_k", "attn_v"})
    llama_family = False  # no other architecture reads its experts: no fallback
    qk_norm = True
    renormalises = True  # build_moe_ffn(..., norm_w=true): norm_topk_prob=False is refused
    expert_width_key = True
