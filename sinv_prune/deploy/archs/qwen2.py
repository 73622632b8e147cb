"""llama.cpp's ``qwen2``: Qwen2 with q/k/v biases, as long as heads x head_dim is the hidden size."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.base import LayerShape
from sinv_prune.deploy.archs.llama_family import LlamaFamilyArch
from sinv_prune.deploy.archs.registry import register


@register
class Qwen2(LlamaFamilyArch):
    name = "qwen2"
    model_arch = gguf.MODEL_ARCH.QWEN2
    families = ("qwen2",)
    optional_biases = frozenset({"attn_q", "attn_k", "attn_v"})

    def refusal(self, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
        reason = super().refusal(config, layers, head_dim, biases)
        if reason is None and layers[0].heads * head_dim != config.hidden_size:
            reason = (
                f"llama.cpp's qwen2 needs heads x head_dim = hidden size "
                f"({layers[0].heads} x {head_dim} != {config.hidden_size})"
            )
        return reason
