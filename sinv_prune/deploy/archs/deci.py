"""llama.cpp's ``deci`` (NVIDIA's Nemotron-NAS): per-layer head counts, KV heads and MLP widths.

It reads ``head_count``, ``head_count_kv`` and ``feed_forward_length`` as per-layer arrays and skips
attention where a layer has 0 heads, so it runs every uneven LLaMA-family cut the other
architectures cannot state; it has no per-head q/k norm (no uneven Qwen3).
"""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.base import LayerShape
from sinv_prune.deploy.archs.llama_family import BIASES, LlamaFamilyArch
from sinv_prune.deploy.archs.registry import register


@register
class Deci(LlamaFamilyArch):
    name = "deci"
    model_arch = gguf.MODEL_ARCH.DECI
    optional_biases = BIASES
    permute_rope = True
    per_layer = True
    fallback = True

    def refusal(self, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
        reason = super().refusal(config, layers, head_dim, biases)
        if reason is not None:
            return reason
        if layers[0].heads == 0:
            return "llama.cpp's deci reads the head size from layer 0, which has no attention heads"
        for i, shape in enumerate(layers):
            if shape.heads == 0 and "attn_output" in biases.get(i, set()):
                return f"llama.cpp's deci skips an attention-free layer entirely, dropping its output bias (layer {i})"
        return None
