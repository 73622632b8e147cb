"""llama.cpp's ``gpt2``: fused QKV with every bias, tanh-GELU, learned positions, one shape for every layer."""

from __future__ import annotations

import gguf

from sinv_prune.deploy.archs.base import GGUFArch
from sinv_prune.deploy.archs.registry import register
from sinv_prune.deploy.errors import ExportRefused

_SKIP = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers, not weights
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # stored [in, out]


@register
class GPT2(GGUFArch):
    name = "gpt2"
    model_arch = gguf.MODEL_ARCH.GPT2
    families = ("gpt2",)
    optional_biases = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})  # its loader needs them all
    full_width_attention = True  # the fused QKV
    hidden_key = "n_embd"
    f32_tolerance = (5e-5, 4e-4)  # llama.cpp's GELU reads an f16 table

    def check_config(self, config) -> None:
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise ExportRefused(
                "cannot export: llama.cpp's gpt2 has no per-layer attention scaling (scale_attn_by_inverse_layer_idx)"
            )
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ExportRefused(f"cannot export: llama.cpp's gpt2 uses tanh-GELU, not {config.activation_function!r}")

    def add_hparams(self, writer: gguf.GGUFWriter, config, layout, n_vocab: int) -> None:
        writer.add_block_count(len(layout.layers))
        writer.add_vocab_size(n_vocab)
        writer.add_feed_forward_length(self.per_layer_value(layout, "ffn"))
        writer.add_head_count(self.per_layer_value(layout, "heads"))
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)

    def tensor_data(self, key: str, data):
        if key.endswith(_SKIP):
            return None
        return data.t() if key.endswith(_CONV1D) else data
