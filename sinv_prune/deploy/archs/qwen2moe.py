"""llama.cpp's ``qwen2moe``: Qwen2-MoE with its sigmoid-gated shared expert; attention spans the hidden size."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.llama_family import LlamaFamilyArch
from sinv_prune.deploy.archs.moe import ExpertsMixin
from sinv_prune.deploy.archs.registry import register


@register
class Qwen2Moe(ExpertsMixin, LlamaFamilyArch):
    name = "qwen2moe"
    model_arch = gguf.MODEL_ARCH.QWEN2MOE
    families = ("qwen2_moe",)
    optional_biases = frozenset({"attn_q", "attn_k", "attn_v"})
    llama_family = False  # no other architecture reads its experts: no fallback
    full_width_attention = True  # its loader sizes q and the output projection from the hidden size
    output_required = True  # loads output.weight without falling back to the embeddings
    renormalises = False  # build_moe_ffn(..., norm_w=false): norm_topk_prob=True is refused
    shared_expert = True
    expert_width_key = True
