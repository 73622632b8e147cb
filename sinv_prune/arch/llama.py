"""LLaMA family (LLaMA, Qwen2, Mistral, ...): ``q/k/v/o_proj`` with grouped-query attention."""

from __future__ import annotations

from sinv_prune.arch.base import (
    HeadAdapter,
    HeadLayout,
    Projections,
    empty_cache_update,
    head_rows,
    select_in,
    select_out,
)
from sinv_prune.arch.registry import register_adapter


@register_adapter
class LlamaAdapter(HeadAdapter):
    name = "llama"
    model_types = ("llama", "qwen2", "mistral", "qwen3")
    config_kv_heads_key = "num_key_value_heads"
    #: Families whose stock config accepts any head count with an explicit head_dim.
    stock_reload = True

    def layer_stack(self):
        return self.base.layers

    def attention(self, layer):
        return self.base.layers[layer].self_attn

    def out_proj(self, layer):
        return self.attention(layer).o_proj

    def layout(self, layer):
        attn = self.attention(layer)
        heads = attn.q_proj.out_features // attn.head_dim
        kv = attn.k_proj.out_features // attn.head_dim
        return HeadLayout(heads, kv, attn.head_dim)

    def projections(self, layer):
        a = self.attention(layer)
        return Projections(
            a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
            a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias,
        )  # fmt: skip

    def mlp(self, layer):
        mlp = self.base.layers[layer].mlp
        return mlp.up_proj.weight, mlp.down_proj.weight

    def mlp_in(self, layer):
        mlp = self.base.layers[layer].mlp
        return [mlp.gate_proj, mlp.up_proj]

    def mlp_out(self, layer):
        return self.base.layers[layer].mlp.down_proj

    def attention_residual_norm(self, layer):
        block = self.base.layers[layer]
        return None if hasattr(block, "post_feedforward_layernorm") else block.input_layernorm

    def mlp_residual_norm(self, layer):
        block = self.base.layers[layer]
        plain = not hasattr(block, "post_feedforward_layernorm") and not self.num_experts(layer)
        return block.post_attention_layernorm if plain else None

    def slice_heads(self, layer, keep_q, keep_kv):
        attn = self.attention(layer)
        q_rows, kv_rows = head_rows(keep_q, attn.head_dim), head_rows(keep_kv, attn.head_dim)
        select_out(attn.q_proj, q_rows)
        select_out(attn.k_proj, kv_rows)
        select_out(attn.v_proj, kv_rows)
        select_in(attn.o_proj, q_rows)
        attn.num_key_value_groups = keep_q.numel() // keep_kv.numel() if keep_kv.numel() else 0

    def empty_forward(self, layer):
        attn = self.attention(layer)

        def forward(hidden_states, *args, **kwargs):
            empty_cache_update(attn.layer_idx, hidden_states, attn.head_dim, args, kwargs)
            return attn.o_proj(hidden_states.new_zeros(*hidden_states.shape[:-1], 0)), None

        return forward
