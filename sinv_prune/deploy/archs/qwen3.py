"""llama.cpp's ``qwen3``: Qwen3 with its per-head q/k norm, one shape for every layer."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.llama_family import LlamaFamilyArch
from sinv_prune.deploy.archs.registry import register


@register
class Qwen3(LlamaFamilyArch):
    name = "qwen3"
    model_arch = gguf.MODEL_ARCH.QWEN3
    families = ("qwen3",)
    optional_biases = frozenset({"attn_q", "attn_k", "attn_v"})
    qk_norm = True
