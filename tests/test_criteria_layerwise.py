"""Criteria read one block at a time (``compute(..., layer_by_layer=True)``) score as the whole-model pass does."""

from __future__ import annotations

import pytest
import torch
from conftest import model_inputs, tiny_model
from test_experts import tiny_moe

from sinv_prune.scoring.criteria import get_criterion
from sinv_prune.surgery import layerwise


def _batches(vocab: int = 64) -> list[dict]:
    """Three batches; the second padded (rows end in different amounts of padding), one with labels."""
    out = []
    for s in range(3):
        batch = model_inputs(seed=10 + s, batch=2, length=12)
        batch["input_ids"] = batch["input_ids"] % vocab
        out.append(batch)
    mask = torch.ones_like(out[1]["input_ids"])
    mask[0, 9:] = 0
    mask[1, 5:] = 0
    out[1]["attention_mask"] = mask
    out[2]["labels"] = out[2]["input_ids"].clone()
    return out


CASES = [
    ("llama", "activation", "heads", {"metric": "fluctuation"}),
    ("llama", "activation", "heads", {"metric": "magnitude"}),
    ("llama", "activation", "mlp", {"metric": "fluctuation"}),
    ("llama", "activation", "mlp", {"metric": "magnitude"}),
    ("llama", "block_influence", "layers", {}),
    ("qwen3_moe", "frequency", "experts", {}),
    ("qwen3_moe", "reap", "experts", {}),
    ("qwen3_moe", "ean", "experts", {}),
    ("qwen3_moe", "activation", "heads", {}),
    ("qwen3_moe", "block_influence", "layers", {}),
]


@pytest.mark.parametrize(("family", "name", "unit", "options"), CASES, ids=lambda v: str(v) if v else "")
def test_layer_by_layer_scores_equal_the_whole_model_pass(family, name, unit, options, monkeypatch):
    model = tiny_model("llama") if family == "llama" else tiny_moe("qwen3_moe")
    batches = _batches()
    whole = get_criterion(name, unit=unit, **options)
    expected = whole.compute(model, batches)

    walked_blocks = []
    walk = layerwise.layer_by_layer

    def counting(*args, **kwargs):
        for layer in walk(*args, **kwargs):
            walked_blocks.append(layer.index)
            yield layer

    monkeypatch.setattr(layerwise, "layer_by_layer", counting)
    walker = get_criterion(name, unit=unit, **options)
    walker.layer_by_layer = True  # the instance's setting is what compute() uses by default
    got = walker.compute(model, batches)
    assert walked_blocks  # it did go through the engine, block by block
    assert walked_blocks == sorted(walked_blocks)
    assert whole.report() == walker.report()  # token and batch counts, routed counts: exact
    flat = lambda s: torch.tensor([x for row in s for x in (row if isinstance(row, list) else [row])])  # noqa: E731
    shape = lambda s: [len(r) if isinstance(r, list) else 1 for r in s]  # noqa: E731
    assert shape(got) == shape(expected)
    torch.testing.assert_close(flat(got), flat(expected), rtol=1e-5, atol=1e-7)


def test_layer_by_layer_keyword_overrides_and_a_criterion_that_cannot_walk_says_so():
    model = tiny_model("llama")
    batches = _batches()
    criterion = get_criterion("block_influence", unit="layers")
    criterion.layer_by_layer = True
    assert criterion.compute(model, batches, layer_by_layer=False) == get_criterion(
        "block_influence", unit="layers"
    ).compute(model, batches)  # the keyword wins: the same whole-model pass, bit for bit
    with pytest.raises(ValueError, match="cannot read its batches one block at a time"):
        get_criterion("taylor").compute(model, batches, layer_by_layer=True)
    with pytest.raises(ValueError, match="batches was empty"):
        criterion.compute(model, [], layer_by_layer=True)


def test_sensitivity_damage_equals_zeroing_the_channels_in_a_whole_model_pass():
    """block_damage walks the blocks through the engine; a whole-model pass with the channels zeroed agrees."""
    import copy

    from sinv_prune.scoring.allocation import Group, block_damage

    model = tiny_model("llama")
    batches = [model_inputs(seed=s, batch=2, length=10) for s in range(2)]
    group = Group("mlp", 1, [float((7 * c) % 64) for c in range(64)], cost=1, allowed=[0, 16, 32, 48])
    damage = block_damage(model, [group], batches, trials=3, quiet=True)

    def block_outputs(m) -> list[torch.Tensor]:
        seen = []
        handle = m.model.layers[1].register_forward_hook(
            lambda mod, a, o: seen.append(o[0] if isinstance(o, tuple) else o)
        )
        with torch.no_grad():
            for batch in batches:
                m(**batch)
        handle.remove()
        return seen

    clean = block_outputs(model)
    norm = sum(float(y.double().square().sum()) for y in clean)
    assert set(damage["mlp", 1]) == {0, 16, 32, 48}
    for k in (16, 32, 48):
        zeroed = copy.deepcopy(model)
        with torch.no_grad():
            zeroed.model.layers[1].mlp.down_proj.weight[:, group.pick(k)] = 0.0
        err = sum(float((y - c).double().square().sum()) for y, c in zip(block_outputs(zeroed), clean, strict=True))
        assert damage["mlp", 1][k] == pytest.approx(err / norm, rel=1e-4)
