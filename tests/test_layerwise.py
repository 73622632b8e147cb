"""The layer-wise engine: each block's outputs equal a whole-model pass's hidden states, one block at a time."""

from __future__ import annotations

import pytest
import torch
from conftest import model_inputs, tiny_model
from test_experts import tiny_moe

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.layerwise import layer_by_layer


def _hidden_states(model, batches) -> list[list[torch.Tensor]]:
    """Per batch, every block's output from one whole-model forward (independent of the engine)."""
    outs: list[torch.Tensor] = []
    blocks = get_adapter(model).layers()
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o)) for b in blocks]
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    for h in hooks:
        h.remove()
    n = len(blocks)
    return [outs[j * n : (j + 1) * n] for j in range(len(batches))]


@pytest.mark.parametrize(
    "make",
    [
        lambda: tiny_model("llama"),
        lambda: tiny_model(
            "qwen2",
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=4,
            use_sliding_window=True,
        ),  # fmt: skip
        lambda: tiny_moe("qwen3_moe"),
        lambda: tiny_model("gpt2"),
    ],
    ids=["llama", "qwen2-sliding", "qwen3_moe", "gpt2"],
)
def test_each_block_sees_what_a_whole_pass_gives_it(make):
    model = make()
    batches = [model_inputs(seed=s, batch=2, length=9) for s in range(3)]
    reference = _hidden_states(model, batches)
    walked = []
    for layer in layer_by_layer(model, get_adapter(model), batches):
        ins = [h.clone() for h in layer.hidden]
        outs = layer.run()
        walked.append(layer.index)
        for j, out in enumerate(outs):
            torch.testing.assert_close(out, reference[j][layer.index], rtol=0, atol=1e-6)
            if layer.index:
                torch.testing.assert_close(ins[j], reference[j][layer.index - 1], rtol=0, atol=1e-6)
    assert walked == list(range(get_adapter(model).num_layers))


def test_unrun_blocks_still_advance_and_layers_stop_early():
    model = tiny_model("llama")
    batches = [model_inputs(seed=1)]
    reference = _hidden_states(model, batches)
    seen = []
    for layer in layer_by_layer(model, get_adapter(model), batches, layers=[1]):
        seen.append(layer.index)
        torch.testing.assert_close(layer.hidden[0], reference[0][0], rtol=0, atol=1e-6)  # block 0 ran by itself
    assert seen == [1]
