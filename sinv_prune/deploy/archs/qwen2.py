"""llama.cpp's ``qwen2``: Qwen2 with q/k/v biases, as long as heads x head_dim is the hidden size."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.llama_family import LlamaFamilyArch
from sinv_prune.deploy.archs.registry import register


@register
class Qwen2(LlamaFamilyArch):
    name = "qwen2"
    model_arch = gguf.MODEL_ARCH.QWEN2
    families = ("qwen2",)
    optional_biases = frozenset({"attn_q", "attn_k", "attn_v"})
    full_width_attention = True
