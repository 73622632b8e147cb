"""BERT family: ``attention.self.{query,key,value}`` and ``attention.output.dense``.

Serves BERT, RoBERTa and the encoders that share their modules, bare or inside
``*ForSequenceClassification`` / ``*ForMaskedLM`` and similar heads.
"""

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
class BertAdapter(HeadAdapter):
    name = "bert"
    model_types = ("bert", "roberta", "xlm-roberta", "camembert", "electra")

    def layer_stack(self):
        return self.base.encoder.layer

    def attention(self, layer):
        return self.base.encoder.layer[layer].attention.self

    def out_proj(self, layer):
        return self.base.encoder.layer[layer].attention.output.dense

    def layout(self, layer):
        attn = self.attention(layer)
        return HeadLayout(attn.num_attention_heads, attn.num_attention_heads, attn.attention_head_size)

    def projections(self, layer):
        attn, out = self.attention(layer), self.out_proj(layer)
        return Projections(
            attn.query.weight, attn.key.weight, attn.value.weight, out.weight,
            attn.query.bias, attn.key.bias, attn.value.bias, out.bias,
        )  # fmt: skip

    def mlp(self, layer):
        block = self.base.encoder.layer[layer]
        return block.intermediate.dense.weight, block.output.dense.weight

    def mlp_in(self, layer):
        return [self.base.encoder.layer[layer].intermediate.dense]

    def mlp_out(self, layer):
        return self.base.encoder.layer[layer].output.dense

    def slice_heads(self, layer, keep_q, keep_kv):
        attn = self.attention(layer)
        rows = head_rows(keep_q, attn.attention_head_size)
        for proj in (attn.query, attn.key, attn.value):
            select_out(proj, rows)
        select_in(self.out_proj(layer), rows)
        attn.num_attention_heads = int(keep_q.numel())
        attn.all_head_size = attn.num_attention_heads * attn.attention_head_size

    def empty_forward(self, layer):
        attn = self.attention(layer)

        def forward(hidden_states, *args, **kwargs):
            empty_cache_update(attn.layer_idx, hidden_states, attn.attention_head_size, args, kwargs)
            return hidden_states.new_zeros(*hidden_states.shape[:-1], 0), None

        return forward
