"""``rounds > 1`` for MLP channels, layers and mixes: every round re-scores the pruned model, the totals
are the one-shot plan's, and the combined summary is exactly what the model lost."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import model_inputs, model_output, tiny_model

from sinv_prune import Part, Pruner, get_adapter
from sinv_prune.scoring.criteria import get_criterion
from sinv_prune.scoring.criteria.base import Criterion, channel_counts
from sinv_prune.surgery import removal as surgery
from sinv_prune.surgery.record import get_record
from sinv_prune.units.mlp.selection import select_channels


class Spy(Criterion):
    """A registered criterion that notes the model's shape every time it scores."""

    def __init__(self, name: str, unit: str, seen: list):
        self.inner, self.seen = get_criterion(name, unit=unit, **({"seed": 3} if name == "random" else {})), seen
        self.name, self.units, self.needs_data = name, (unit,), self.inner.needs_data

    def reset(self):
        self.inner.reset()

    def update(self, model, batch):
        self.inner.update(model, batch)

    def scores(self, model):
        adapter = get_adapter(model)
        self.seen.append((self.unit, adapter.num_layers, channel_counts(model)))
        return self.inner.scores(model)


def counts(plan: dict) -> dict:
    return {u: len(v) if u == "layers" else sum(map(len, v.values())) for u, v in plan.items()}


def same_model_with_plan(reference, summary) -> torch.nn.Module:
    """The start model cut once by the summary's plan (numbered as the model was before the rounds)."""
    plan = {"layers": summary.removed_layers, "heads": {c.layer: c.removed for c in summary.layers},
            "mlp": {c.layer: c.removed for c in summary.mlp}}  # fmt: skip
    surgery.prune(reference, {k: v for k, v in plan.items() if v}, allow_empty_layers=True)
    return reference


def parts(seen: list, *units: str, mlp_amount=0.5, **mlp) -> list[Part]:
    made = {
        "heads": Part("heads", Spy("magnitude", "heads", seen), 4, mode="global"),
        "mlp": Part("mlp", Spy("magnitude", "mlp", seen), mlp_amount, **mlp),
        "layers": Part("layers", Spy("block_influence", "layers", seen), 3),
    }
    return [made[u] for u in units]


@pytest.mark.parametrize(
    "units",
    [("mlp",), ("layers",), ("layers", "mlp"), ("heads", "mlp"), ("layers", "heads", "mlp")],
)
def test_rounds_rescore_reach_the_one_shot_totals_and_equal_one_cut(units):
    model = tiny_model("llama", num_hidden_layers=5, num_key_value_heads=6)  # 6 heads per layer, MHA
    start = copy.deepcopy(model)
    batches = (model_inputs(seed) for seed in range(2))  # an iterator: read once, used every round
    seen, between = [], []
    one_shot = Pruner(parts([], *units)).select(copy.deepcopy(model), batches=[model_inputs(s) for s in range(2)])
    pruner = Pruner(parts(seen, *units), rounds=3, between_rounds=lambda m, i: between.append(i))
    summary = pruner.prune(model, batches=batches)

    totals = counts(one_shot)
    assert {u: summary.to_dict()[f"{ {'mlp': 'channels'}.get(u, u) }_removed"] for u in units} == totals
    per_round = pruner.report()["per_round"]
    assert len(per_round) == 3 and between == [0, 1]
    assert len(seen) == 3 * len(units)  # round 0 uses the scores select() computed; rounds 1 and 2 re-score
    for unit in units:
        key = {"mlp": "channels", "heads": "heads", "layers": "layers"}[unit] + "_removed"
        removed = [r[key] for r in per_round]
        assert sum(removed) >= totals[unit] and max(removed) < totals[unit]  # spread, not all at once
    # later rounds score the smaller model
    shapes = [(layers, sum(widths)) for _, layers, widths in seen]
    assert shapes[-1] < shapes[0]
    # the combined summary is exactly what was removed: one cut by it gives the same model
    inputs = model_inputs(9)
    torch.testing.assert_close(model_output(model, inputs), model_output(same_model_with_plan(start, summary), inputs))
    assert pruner.last_selection == {u: v for u, v in {"layers": summary.removed_layers,
                                                      "heads": {c.layer: c.removed for c in summary.layers},
                                                      "mlp": {c.layer: c.removed for c in summary.mlp}}.items()
                                     if u in units}  # fmt: skip
    json.dumps(pruner.report())


def test_a_layer_dropped_late_does_not_shrink_the_heads_cut():
    """Heads removed in a layer a later round drops are counted again: the heads that stay reach the total."""
    model = tiny_model("llama", num_hidden_layers=4, num_key_value_heads=6)
    scores_seen = []

    class LayerOneGoesLast(Criterion):  # round 1: layer 1 is kept; round 2: whichever layer is original 1 goes
        name, units = "late", ("layers",)

        def scores(self, m):
            kept = get_record(m.config).kept_layers() if get_record(m.config) else list(range(4))
            scores_seen.append(kept)
            return [0.0 if orig == 1 and len(scores_seen) > 2 else 1.0 + orig for orig in kept]

    class HeadsOfLayerOneFirst(Criterion):
        name, units = "early", ("heads",)

        def scores(self, m):
            kept = get_record(m.config).kept_layers() if get_record(m.config) else list(range(4))
            return [[(0.0 if orig == 1 else 1.0) + 0.01 * h for h in range(get_adapter(m).layout(i).num_heads)]
                    for i, orig in enumerate(kept)]  # fmt: skip

    pruner = Pruner([Part("layers", LayerOneGoesLast(), 2), Part("heads", HeadsOfLayerOneFirst(), 4)], rounds=2)
    summary = pruner.prune(model)
    first, second = pruner.report()["per_round"]
    assert "1" in first["selection"]["heads"] and 1 in second["selection"]["layers"]  # cut in round 1, dropped later
    assert summary.heads_removed == 4 and 1 in summary.removed_layers_original
    assert second["requested"]["heads"] > 2  # half of 4 plus what went with layer 1


def test_channel_rounds_keep_the_floor_of_the_start_width():
    """global mode: no layer ends below a quarter of its width at the start, however many rounds."""
    model = tiny_model("llama", num_hidden_layers=4)  # 4 x 64 channels; 75% of all is the most one cut may take
    pruner = Pruner([Part("mlp", "random", 0.75, criterion_options={"seed": 5})], rounds=3)
    summary = pruner.prune(model)
    assert summary.channels_removed == 192 and channel_counts(model) == [16, 16, 16, 16]


def test_rounds_take_the_ceiling_of_what_is_left_over_the_rounds_left():
    """10 channels in 3 rounds: ceil(10/3), ceil(7/2), ceil(3/1) = 4, 3, 3 (the floor would give 3, 3, 4)."""
    model = tiny_model("llama", num_hidden_layers=3)
    pruner = Pruner([Part("mlp", "magnitude", 10, mode="global")], rounds=3)
    summary = pruner.prune(model)
    per_round = pruner.report()["per_round"]
    assert [r["requested"]["mlp"] for r in per_round] == [4, 3, 3]
    assert [r["channels_removed"] for r in per_round] == [4, 3, 3] and summary.channels_removed == 10


def test_channel_rounds_with_a_multiple_keep_it_and_stop_at_the_total():
    model = tiny_model("llama", num_hidden_layers=3)
    pruner = Pruner([Part("mlp", "magnitude", 0.25, mode="uniform", multiple=8)], rounds=2)
    summary = pruner.prune(model)
    assert summary.channels_removed == 48 and all(w % 8 == 0 for w in channel_counts(model))
    assert [r["channels_removed"] for r in pruner.report()["per_round"]] == [24, 24]


def test_per_layer_floors_in_select_channels():
    rows = [[float(i) for i in range(8)] for _ in range(2)]
    chosen = select_channels([8, 8], rows, 10, min_channels_per_layer=[1, 5])
    assert {layer: len(c) for layer, c in chosen.items()} == {0: 7, 1: 3}
    with pytest.raises(ValueError, match="2 floors for 3 layers"):
        select_channels([8, 8, 8], rows + rows[:1], 1, min_channels_per_layer=[1, 1])
    with pytest.raises(ValueError, match="mode 'uniform' takes one min_channels_per_layer"):
        select_channels([8, 8], rows, 2, mode="uniform", min_channels_per_layer=[1, 1])


def test_rounds_refuse_a_non_uniform_allocation():
    with pytest.raises(ValueError, match="a non-uniform allocation needs rounds=1"):
        Pruner([Part("mlp", "magnitude", {"params": 0.1}, allocation="standardized")], rounds=2)
