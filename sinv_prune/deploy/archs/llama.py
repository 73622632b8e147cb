"""llama.cpp's ``llama``: LLaMA, Mistral and Mixtral (routed experts) natively; any LLaMA-family model whose
layers share one shape."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.llama_family import BIASES, LlamaFamilyArch
from sinv_prune.deploy.archs.moe import ExpertsMixin
from sinv_prune.deploy.archs.registry import register


@register
class Llama(ExpertsMixin, LlamaFamilyArch):
    name = "llama"
    model_arch = gguf.MODEL_ARCH.LLAMA
    families = ("llama", "mistral", "mixtral")
    renormalises = True  # its MoE branch: build_moe_ffn(..., norm_w=true), as Mixtral's router does
    optional_biases = BIASES
    permute_rope = True
    fallback = True  # e.g. a uniform Qwen2 whose query width is no longer the hidden size
