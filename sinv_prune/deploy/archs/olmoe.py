"""llama.cpp's ``olmoe``: OLMoE, whose q/k norms span the whole projection (all heads together).

Its loader sizes q, k, v, the output projection and both norms from the hidden size, so it needs
every head and as many KV heads as query heads; it has no ``clip_qkv``.
"""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.base import LayerShape
from sinv_prune.deploy.archs.llama_family import LlamaFamilyArch
from sinv_prune.deploy.archs.moe import ExpertsMixin
from sinv_prune.deploy.archs.registry import register
from sinv_prune.deploy.errors import ExportRefused


@register
class Olmoe(ExpertsMixin, LlamaFamilyArch):
    name = "olmoe"
    model_arch = gguf.MODEL_ARCH.OLMOE
    families = ("olmoe",)
    llama_family = False  # no other architecture reads its experts: no fallback
    full_width_attention = True
    output_required = True
    renormalises = False  # build_moe_ffn(..., norm_w=false): norm_topk_prob=True is refused

    def check_config(self, config) -> None:
        super().check_config(config)
        if getattr(config, "clip_qkv", None) is not None:
            raise ExportRefused(f"cannot export: llama.cpp's olmoe does not clip q, k, v (clip_qkv={config.clip_qkv})")

    def refusal(self, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
        reason = super().refusal(config, layers, head_dim, biases)
        if reason is None and layers[0].kv_heads != layers[0].heads:
            return (
                f"llama.cpp's olmoe sizes k and its norm from the hidden size: it needs as many KV heads as "
                f"query heads ({layers[0].kv_heads} != {layers[0].heads})"
            )
        return reason
