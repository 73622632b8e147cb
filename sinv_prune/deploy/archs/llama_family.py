"""What llama.cpp's LLaMA-family architectures (llama, deci, qwen2, qwen3) share: settings, keys, RoPE."""

from __future__ import annotations

import math

import gguf
import numpy as np

from sinv_prune.deploy.archs.base import GGUFArch, LayerShape
from sinv_prune.deploy.errors import ExportRefused

#: RoPE types written (llama3 through a ``rope_freqs`` tensor, as llama.cpp's converter does).
ROPE_TYPES = ("default", "linear", "llama3")
BIASES = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})


def rope_parameters(config) -> dict:
    """The config's RoPE settings (transformers 5 ``rope_parameters``, older ``rope_theta``/``rope_scaling``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in rope:
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        rope.setdefault("rope_type" if key == "type" else key, value)
    return rope


class LlamaFamilyArch(GGUFArch):
    """llama / deci / qwen2 / qwen3: RMSNorm, SiLU gated MLP, rotary attention with GQA."""

    llama_family = True
    #: Whether it has Qwen3's per-head q/k RMSNorm.
    qk_norm = False

    def check_config(self, config) -> None:
        if config.hidden_act != "silu":
            raise ExportRefused(f"cannot export: llama.cpp's {self.name} MLP uses SiLU, not {config.hidden_act!r}")
        if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
            raise ExportRefused(
                "cannot export: llama.cpp's llama/deci rotate the whole head (partial_rotary_factor < 1)"
            )
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
            getattr(config, "layer_types", None) or ()
        ):
            raise ExportRefused(f"cannot export: llama.cpp's {self.name} has no sliding-window layers")
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            raise ExportRefused(
                f"cannot export: rope_type {rope['rope_type']!r} is not written ({', '.join(ROPE_TYPES)} are)"
            )

    def refusal(self, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
        reason = super().refusal(config, layers, head_dim, biases)
        if reason is not None:
            return reason
        if config.model_type in ("qwen3", "qwen3_moe") and not self.qk_norm:
            return f"llama.cpp's {self.name} has no per-head q/k norm (Qwen3's q_norm / k_norm)"
        if not self.per_layer and layers[0].heads == 0:
            return f"llama.cpp's {self.name} cannot skip attention (every layer lost all its heads)"
        return None

    def add_hparams(self, writer: gguf.GGUFWriter, config, layout, n_vocab: int) -> None:
        writer.add_block_count(len(layout.layers))
        writer.add_vocab_size(n_vocab)
        writer.add_feed_forward_length(self.ffn_length(layout))
        writer.add_head_count(self.per_layer_value(layout, "heads"))
        writer.add_head_count_kv(self.per_layer_value(layout, "kv_heads"))
        context = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if layout.family in ("mistral", "mixtral") and window and window < context:
            context = window  # llama.cpp's llama has no sliding window: within it, both compute the same
            layout.notes.append(f"context length {window}: Mistral's sliding window, which llama.cpp's llama lacks")
        writer.add_context_length(context)
        writer.add_embedding_length(config.hidden_size)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_key_length(layout.head_dim)
        writer.add_value_length(layout.head_dim)
        writer.add_rope_dimension_count(layout.head_dim)
        rope = rope_parameters(config)
        writer.add_rope_freq_base(float(rope["rope_theta"]))
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))

    def ffn_length(self, layout) -> int | list[int]:
        """``feed_forward_length``: the MLP width (one, or one per layer)."""
        return self.per_layer_value(layout, "ffn")

    def extra_tensors(self, config, head_dim: int) -> list[tuple[str, np.ndarray]]:
        """``rope_freqs`` for Llama-3 RoPE scaling, computed as llama.cpp's converter does."""
        rope = rope_parameters(config)
        if rope.get("rope_type") != "llama3":
            return []
        base = rope["rope_theta"]
        freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old = rope.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old / low, old / high
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                factors.append(1.0)
            elif wavelen > low_wavelen:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return [("rope_freqs.weight", np.array(factors, dtype=np.float32))]
