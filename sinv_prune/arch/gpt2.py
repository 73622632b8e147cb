"""GPT-2: fused ``Conv1D`` ``c_attn`` (q | k | v columns), ``c_proj``, ``split_size``."""

from __future__ import annotations

import torch

from sinv_prune.arch.base import (
    HeadAdapter,
    HeadLayout,
    Projections,
    empty_cache_update,
    head_rows,
    linear_weight,
    select_in,
    select_out,
)
from sinv_prune.arch.registry import register_adapter


@register_adapter
class GPT2Adapter(HeadAdapter):
    name = "gpt2"
    model_types = ("gpt2",)
    config_heads_key = "n_head"
    config_intermediate_key = "n_inner"

    def layer_stack(self):
        return self.base.h

    def attention(self, layer):
        return self.base.h[layer].attn

    def out_proj(self, layer):
        return self.attention(layer).c_proj

    def layout(self, layer):
        attn = self.attention(layer)
        return HeadLayout(attn.num_heads, attn.num_heads, attn.head_dim)

    def projections(self, layer):
        attn = self.attention(layer)
        q, k, v = linear_weight(attn.c_attn).split(attn.split_size, dim=0)
        qb, kb, vb = attn.c_attn.bias.split(attn.split_size, dim=0)
        return Projections(q, k, v, linear_weight(attn.c_proj), qb, kb, vb, attn.c_proj.bias)

    def config_intermediate_size(self, config):
        return config.n_inner or 4 * config.n_embd

    def mlp(self, layer):
        mlp = self.base.h[layer].mlp
        return linear_weight(mlp.c_fc), linear_weight(mlp.c_proj)

    def mlp_in(self, layer):
        return [self.base.h[layer].mlp.c_fc]

    def mlp_out(self, layer):
        return self.base.h[layer].mlp.c_proj

    def slice_heads(self, layer, keep_q, keep_kv):
        attn = self.attention(layer)
        rows = head_rows(keep_q, attn.head_dim)
        width = attn.split_size
        select_out(attn.c_attn, torch.cat([rows, rows + width, rows + 2 * width]))
        select_in(attn.c_proj, rows)
        attn.num_heads = int(keep_q.numel())
        attn.split_size = attn.num_heads * attn.head_dim

    def empty_forward(self, layer):
        attn = self.attention(layer)

        def forward(hidden_states, *args, **kwargs):
            empty_cache_update(attn.layer_idx, hidden_states, attn.head_dim, args, kwargs)
            # Conv1D cannot take a zero-width input; with no heads its output is its bias.
            out = attn.c_proj.bias.expand(*hidden_states.shape[:-1], attn.c_proj.nf)
            return attn.resid_dropout(out), None

        return forward
