"""HeadPruner end to end: the pruned model computes what the gated (masked) original computes."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
import yaml
from conftest import model_inputs, model_output, tiny_model

from sinv_prune import channel_gates, get_adapter, head_gates, head_measures, prune_heads
from sinv_prune.pipeline.recipe import validate_recipe
from sinv_prune.scoring.criteria import BlockInfluenceCriterion, Criterion, RandomCriterion, get_criterion
from sinv_prune.scoring.pruner import HeadPruner, Part, Pruner
from sinv_prune.surgery import removal as surgery
from sinv_prune.surgery.record import get_record
from sinv_prune.surgery.removal import PruneSummary
from sinv_prune.units.heads.selection import model_layouts, select_heads


def masked_output(model, heads: dict[int, list[int]], inputs) -> torch.Tensor:
    """The output of ``model`` with the given heads gated to zero (nothing removed)."""
    with head_gates(model, requires_grad=False) as gates:
        for layer, removed in heads.items():
            gates[layer][removed] = 0.0
        return model_output(model, inputs)


@pytest.mark.parametrize(
    ("which", "criterion", "mode"),
    [
        ("llama", "taylor", "global"),
        ("llama", "magnitude", "uniform"),
        ("llama", "entropy", "per_layer"),
        ("gpt2", "taylor", "per_layer"),
        ("gpt2", "sinv_static", "global"),
        ("gpt2", "random", "uniform"),
    ],
)
def test_prune_equals_masked_reference(which, criterion, mode):
    model = tiny_model(which)
    reference = copy.deepcopy(model)
    batches = [model_inputs(seed) for seed in range(2)]
    pruner = HeadPruner(criterion, 0.5, mode=mode)
    summary = pruner.prune(model, batches=batches)

    heads = pruner.last_selection["heads"]
    assert summary.heads_removed == sum(map(len, heads.values())) > 0
    assert summary.params_after < summary.params_before
    inputs = model_inputs(7)
    torch.testing.assert_close(model_output(model, inputs), masked_output(reference, heads, inputs))
    if mode == "uniform":
        assert len(set(model_layouts(model))) == 1
    json.dumps(pruner.report())


def test_sinv_early_through_the_pruner():
    model = tiny_model("llama")
    cq = head_measures(model, keys=["C_Q"])["C_Q"]
    cq[1][3:6] = [0.01, 0.02, 0.03]  # the heads of one KV group "converged" early
    trace = [{"step": 0, "epoch": 1.0, "C_Q": cq}]
    pruner = HeadPruner("sinv_early", 3, layout="kv_groups", criterion_options={"threshold": 0.05})
    pruner.prune(model, trace=trace)
    assert pruner.last_selection == {"heads": {1: [3, 4, 5]}}
    assert pruner.report()["parts"][0]["criterion_report"]["crossed"] == 3


def test_criterion_by_name_instance_and_seed():
    model = tiny_model("gpt2")
    assert HeadPruner("random", 3, seed=5).parts[0].criterion.seed == 5
    assert HeadPruner("random", 3, seed=5, criterion_options={"seed": 1}).parts[0].criterion.seed == 1
    by_name = HeadPruner("random", 3, seed=5).select(model)
    assert by_name == HeadPruner(RandomCriterion(seed=5), 3, seed=5).select(model)
    with pytest.raises(ValueError, match="known criteria"):
        HeadPruner("nope", 3)
    with pytest.raises(ValueError, match="only apply when criterion is given by name"):
        HeadPruner(RandomCriterion(), 3, criterion_options={"seed": 1})
    with pytest.raises(ValueError, match="unknown selection mode"):
        HeadPruner("random", 3, mode="local")
    with pytest.raises(ValueError, match="unknown selection layout 'groups'; choose one of q_per_group"):
        HeadPruner("random", 3, layout="groups")
    with pytest.raises(ValueError, match="needs data"):
        HeadPruner("taylor", 3).prune(model)


class LayerOneLow(Criterion):
    """An unregistered criterion: layer 1 scores lowest."""

    def scores(self, model):
        return [[0.0 if layer == 1 else 1.0] * lay.num_heads for layer, lay in enumerate(model_layouts(model))]


def test_min_heads_zero_may_empty_layers():
    model = tiny_model("gpt2")
    reference = copy.deepcopy(model)
    pruner = HeadPruner(LayerOneLow(), 4, min_heads_per_layer=0)
    pruner.prune(model)
    assert pruner.last_selection == {"heads": {1: [0, 1, 2, 3]}}
    inputs = model_inputs(3)
    torch.testing.assert_close(model_output(model, inputs), masked_output(reference, {1: [0, 1, 2, 3]}, inputs))


class GroupAlike(Criterion):
    """Scores a KV group's heads alike (as magnitude does), so a whole group is the cheapest cut."""

    def scores(self, model):
        return [[float(h // lay.group_size) + 0.01 * h for h in range(lay.num_heads)] for lay in model_layouts(model)]


@pytest.mark.parametrize(
    ("layout", "amount", "kept"),
    [(None, 6, (4, 2)), ("q_per_group", 6, (4, 2)), ("kv_groups", 9, (3, 1)), ("auto", 9, (3, 1))],
)
def test_layout_passes_through(layout, amount, kept):
    model = tiny_model("llama")  # 3 layers, 2 KV groups of 3 query heads
    pruner = HeadPruner(GroupAlike(), amount, mode="uniform", **({"layout": layout} if layout else {}))
    pruner.prune(model)
    assert {(lay.num_heads, lay.num_kv_heads) for lay in model_layouts(model)} == {kept}
    assert pruner.report()["parts"][0]["layout"] == (layout or "q_per_group")
    assert f"layout={pruner.parts[0].layout!r}" in repr(pruner)


def test_docstring_recipe_is_a_valid_arm_of_the_example():
    """The YAML in HeadPruner's docstring parses with the recipe schema and says what its Python example says."""
    doc = textwrap.dedent(HeadPruner.__doc__.split("\n", 1)[1])
    block = doc.split(".. code-block:: yaml", 1)[1]
    fragment = yaml.safe_load(textwrap.dedent(block))
    recipe = validate_recipe({"model": {"path": "some/model"}, "data": {"synthetic": {}}, **fragment})
    (arm,) = recipe.prune.arms
    example = next(line for line in doc.splitlines() if line.startswith(">>> pruner = "))
    pruner = eval(example.split("=", 1)[1], {"HeadPruner": HeadPruner})  # noqa: S307 - our own docstring
    (part,) = pruner.parts
    assert (arm.criterion, arm.amount, arm.mode, arm.layout, arm.min_heads_per_layer) == (
        part.criterion.name,
        part.amount,
        part.mode,
        part.layout,
        part.min_per_layer,
    )


# -- iterative pruning --------------------------------------------------------------------


def one_shot(model, criterion: str, amount, mode: str, batches) -> dict[int, list[int]]:
    """The one-shot path without rounds: scores, select_heads, prune_heads."""
    scores = get_criterion(criterion).compute(model, batches)
    heads = select_heads(scores, amount, layouts=model, mode=mode)
    prune_heads(model, heads)
    return heads


@pytest.mark.parametrize(
    ("which", "criterion", "amount", "mode"),
    [("llama", "activation", 6, "uniform"), ("gpt2", "taylor", 0.5, "global"), ("qwen2", "magnitude", 5, "per_layer")],
)
def test_one_round_is_one_shot(which, criterion, amount, mode):
    model, reference = tiny_model(which), tiny_model(which)
    batches = [model_inputs(seed) for seed in range(2)]
    calls = []
    pruner = HeadPruner(criterion, amount, mode=mode, rounds=1, between_rounds=lambda m, i: calls.append(i))
    summary = pruner.prune(model, batches=batches)
    expected = one_shot(reference, criterion, amount, mode, batches)
    assert pruner.last_selection == {"heads": expected} and expected
    assert summary.heads_removed == sum(map(len, expected.values()))
    assert calls == []
    assert model.config.sinv_prune == reference.config.sinv_prune
    reference_state = reference.state_dict()
    assert all(torch.equal(t, reference_state[k]) for k, t in model.state_dict().items())
    report = pruner.report()
    assert report["rounds"] == 1 and [r["heads_removed"] for r in report["per_round"]] == [summary.heads_removed]


@pytest.mark.parametrize(
    ("which", "amount", "rounds", "removed_per_round"),
    [
        ("gpt2", 9, 3, [3, 3, 3]),  # one head per layer per round
        ("llama", 12, 3, [6, 6]),  # a uniform q_per_group step is 6 heads: 4 and then 3 round up to 6
        ("llama", 6, 1, [6]),
    ],
)
def test_uniform_rounds_are_each_uniform_and_reach_the_amount(which, amount, rounds, removed_per_round):
    model = tiny_model(which)
    seen = []

    def between(m, index):
        seen.append((index, {(lay.num_heads, lay.num_kv_heads) for lay in model_layouts(m)}))

    pruner = HeadPruner("magnitude", amount, mode="uniform", rounds=rounds, between_rounds=between)
    summary = pruner.prune(model)
    assert summary.heads_removed == amount
    assert [r["heads_removed"] for r in pruner.report()["per_round"]] == removed_per_round
    assert [index for index, _ in seen] == list(range(len(removed_per_round) - 1))  # after every round but the last
    assert all(len(shapes) == 1 for _, shapes in seen)  # every layer alike after each round
    assert len(set(model_layouts(model))) == 1


def test_rounds_remove_a_fraction_of_the_original_heads_and_report_original_numbering():
    model = tiny_model("gpt2")  # 12 heads
    pruner = HeadPruner("random", 0.5, rounds=3, seed=1)
    summary = pruner.prune(model)
    per_round = pruner.report()["per_round"]
    assert [r["heads_removed"] for r in per_round] == [2, 2, 2]  # half of 12, not of what is left
    assert summary.heads_removed == 6 and sum(map(len, model.config.sinv_prune["pruned_heads"].values())) == 6
    union: dict[str, set] = {}
    for entry in per_round:
        for layer, heads in entry["selection"]["heads"].items():
            assert not union.setdefault(layer, set()) & set(heads)  # original numbering: never the same head twice
            union[layer] |= set(heads)
    assert {k: sorted(v) for k, v in union.items() if v} == model.config.sinv_prune["pruned_heads"]
    json.dumps(pruner.report())


def test_rounds_rescore_after_between_rounds():
    """What between_rounds does to the model is seen by the next round's scores."""
    model = tiny_model("gpt2")
    scores = get_criterion("magnitude").compute(model)
    strongest = max(((layer, h) for layer in range(3) for h in range(4)), key=lambda lh: scores[lh[0]][lh[1]])

    def zero_strongest(m, index):
        record = get_record(m.config)
        layer, original = strongest
        h = record.kept_heads(layer).index(original)
        w, d = get_adapter(m).projections(layer), 8
        with torch.no_grad():
            for t in (w.q[h * d : (h + 1) * d], w.k[h * d : (h + 1) * d], w.v[h * d : (h + 1) * d]):
                t.zero_()
            w.o[:, h * d : (h + 1) * d].zero_()

    pruner = HeadPruner("magnitude", 4, rounds=2, between_rounds=zero_strongest)
    pruner.prune(model)
    first, second = (r["selection"]["heads"] for r in pruner.report()["per_round"])
    assert str(strongest[0]) not in first or strongest[1] not in first[str(strongest[0])]
    assert strongest[1] in second[str(strongest[0])]


@pytest.mark.parametrize("criterion", ["taylor", "activation", "magnitude"])
def test_rounds_on_a_pruned_model_equal_the_masked_reference(criterion):
    """last_selection and the summary number heads as the model had them when prune() was called."""
    model = tiny_model("llama")
    prune_heads(model, {1: [0, 3]})  # layer 1 now has heads 1, 2, 4, 5 of the original
    reference = copy.deepcopy(model)
    batches = (model_inputs(seed) for seed in range(2))  # a one-shot iterator: read once, used every round
    pruner = HeadPruner(criterion, 6, rounds=3, mode="global")
    summary = pruner.prune(model, batches=batches)
    assert summary.heads_removed == 6 and len(pruner.report()["per_round"]) == 3
    assert pruner.last_selection == {"heads": {c.layer: c.removed for c in summary.layers}}
    kept = get_record(reference.config).kept_heads
    assert all([kept(c.layer)[h] for h in c.removed] == c.removed_original for c in summary.layers)
    inputs = model_inputs(7)
    heads = pruner.last_selection["heads"]
    torch.testing.assert_close(model_output(model, inputs), masked_output(reference, heads, inputs))


def test_rounds_errors_before_any_change():
    model = tiny_model("gpt2")
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="rounds must be a positive integer"):
            HeadPruner("random", 3, rounds=bad)
    with pytest.raises(ValueError, match="between_rounds must be a callable"):
        HeadPruner("random", 3, rounds=2, between_rounds=3)
    with pytest.raises(ValueError, match="larger than the 12 heads"):
        HeadPruner("random", 13, rounds=2).prune(model)
    with pytest.raises(ValueError, match="cannot remove exactly 4 heads in mode 'uniform'"):
        HeadPruner("random", 4, mode="uniform", rounds=2, exact=True).prune(model)
    assert get_record(model.config) is None


# -- Pruner: parts for every unit, one plan, one removal call ------------------------------


def test_part_checks_its_settings():
    with pytest.raises(ValueError, match="unknown unit 'neurons'; choose one of heads, mlp, experts, layers"):
        Part("neurons", "random", 1)
    with pytest.raises(ValueError, match="criterion 'entropy' does not score 'mlp'; it scores: heads"):
        Part("mlp", "entropy", 1)
    with pytest.raises(ValueError, match="scores 'heads', not 'mlp'"):
        Part("mlp", RandomCriterion(), 1)
    with pytest.raises(ValueError, match="layout applies to heads parts only"):
        Part("mlp", "random", 1, layout="kv_groups")
    with pytest.raises(ValueError, match="multiple applies to mlp parts only"):
        Part("heads", "random", 1, multiple=8)
    with pytest.raises(ValueError, match="its mode must be 'global'"):
        Part("layers", "random", 1, mode="per_layer")
    with pytest.raises(ValueError, match="min_per_layer must be at least 1 for 'mlp'"):
        Part("mlp", "random", 1, min_per_layer=0)
    with pytest.raises(ValueError, match="multiple must be a positive integer"):
        Part("mlp", "random", 1, multiple=0)
    with pytest.raises(ValueError, match="criterion_options only apply"):
        Part("mlp", get_criterion("random", unit="mlp"), 1, criterion_options={"seed": 1})
    assert Part("layers", "random", 1, seed=4).criterion.seed == 4
    assert Part("mlp", get_criterion("magnitude", unit="mlp"), 1).criterion.unit == "mlp"
    assert Part("layers", BlockInfluenceCriterion(), 1).criterion.unit == "layers"


def test_pruner_checks_its_parts():
    with pytest.raises(ValueError, match="non-empty list of Part"):
        Pruner([])
    with pytest.raises(ValueError, match="parts must be Part instances"):
        Pruner(["heads"])
    with pytest.raises(ValueError, match="one part per unit"):
        Pruner([Part("mlp", "random", 1), Part("mlp", "magnitude", 1)])
    with pytest.raises(ValueError, match="a non-uniform allocation needs rounds=1"):
        Pruner([Part("heads", "random", 1), Part("mlp", "random", 1, allocation="standardized")], rounds=2)
    with pytest.raises(ValueError, match="unknown compensation"):
        Pruner([Part("mlp", "random", 1)], compensate="magic")
    pruner = Pruner(
        [Part("mlp", "random", 1), Part("heads", "random", 1, min_per_layer=0), Part("layers", "random", 1)]
    )
    assert [p.unit for p in pruner.parts] == ["layers", "heads", "mlp"]  # layers are selected first
    assert pruner.allow_empty_layers and not Pruner([Part("heads", "random", 1)]).allow_empty_layers


def test_mixed_select_takes_layers_first_and_meets_every_amount():
    """Layer 1 has the lowest heads and channels too: they are not counted, the others' are."""
    model = tiny_model("llama")  # 3 layers of 6 heads (2 KV groups) and 64 channels
    scores = {
        "layers": [0.9, 0.1, 0.5],
        "heads": [[1.0 + h for h in range(6)], [0.0] * 6, [2.0 + h for h in range(6)]],
        "mlp": [[1.0 + c for c in range(64)], [0.0] * 64, [2.0 + c for c in range(64)]],
    }
    pruner = Pruner([Part("heads", "random", 4), Part("mlp", "random", 0.25, multiple=8), Part("layers", "random", 1)])
    plan = pruner.select(model, scores)
    assert plan["layers"] == [1]
    assert plan["heads"] == {0: [0, 1], 2: [0, 1]} or plan["heads"] == {0: [0, 3], 2: [0, 3]}
    assert sum(map(len, plan["heads"].values())) == 4
    assert set(plan["mlp"]) <= {0, 2} and sum(map(len, plan["mlp"].values())) == 32  # a quarter of 2 x 64
    assert all((64 - len(c)) % 8 == 0 for c in plan["mlp"].values())
    assert pruner.last_selection == plan
    without_layers = Pruner([Part("heads", "random", 4), Part("mlp", "random", 8)]).select(model, scores)
    # (global channels are standardised per layer: layer 1's constant scores are z = 0, not the lowest)
    assert 1 in without_layers["heads"] and sum(map(len, without_layers["mlp"].values())) == 8
    with pytest.raises(ValueError, match=r"scores are missing for unit\(s\) \['mlp'\]"):
        pruner.select(model, {"layers": scores["layers"], "heads": scores["heads"]})
    with pytest.raises(ValueError, match="layer scores must have one float for each of the 3 layers"):
        pruner.select(model, {**scores, "layers": [0.1, 0.2]})
    with pytest.raises(ValueError, match="mlp scores must be a list per layer of the 3 layers"):
        pruner.select(model, {**scores, "mlp": scores["mlp"][:2]})


def test_pruner_scores_every_part():
    model = tiny_model("gpt2")
    batches = iter([model_inputs(seed) for seed in range(2)])  # one-shot: read once, used by two criteria
    pruner = Pruner([Part("layers", "block_influence", 1), Part("mlp", "taylor", 16), Part("heads", "magnitude", 2)])
    plan = pruner.select(model, batches=batches)
    assert set(pruner.last_scores) == {"layers", "heads", "mlp"}
    assert len(pruner.last_scores["layers"]) == 3 and [len(r) for r in pruner.last_scores["mlp"]] == [128] * 3
    assert len(plan["layers"]) == 1 and sum(map(len, plan["mlp"].values())) == 16
    report = pruner.report()
    assert [p["unit"] for p in report["parts"]] == ["layers", "heads", "mlp"]
    assert (
        report["parts"][0]["criterion_report"]["batches"] == 2
        and report["parts"][2]["criterion_report"]["batches"] == 2
    )
    assert report["parts"][2]["multiple"] == 1 and report["parts"][1]["layout"] == "q_per_group"
    json.dumps(report)


def test_prune_makes_one_call_to_surgery_prune(monkeypatch):
    calls = []

    def fake_prune(model, plan, **kw):
        calls.append((plan, kw))
        return PruneSummary([], 10, 5)

    monkeypatch.setattr(surgery, "prune", fake_prune, raising=False)
    model = tiny_model("llama")
    batches = [model_inputs(seed) for seed in range(2)]
    pruner = Pruner([Part("mlp", "activation", 0.25, multiple=8), Part("layers", "block_influence", 1)])
    planned = Pruner([Part("mlp", "activation", 0.25, multiple=8), Part("layers", "block_influence", 1)]).select(
        copy.deepcopy(model), batches=batches
    )
    summary = pruner.prune(model, batches=batches)
    assert len(calls) == 1 and calls[0] == (planned, {})
    assert summary.params_after == 5 and set(calls[0][0]) == {"mlp", "layers"}
    # the selection reported is what the removal says it removed (the fake: nothing), not the plan
    assert pruner.last_selection == {"layers": [], "mlp": {}}
    assert pruner.report()["per_round"][0]["selection"] == {"layers": [], "mlp": {}}

    calls.clear()
    compensated = Pruner([Part("mlp", "magnitude", 8)], compensate="lsq", compensation_options={"ridge": 0.1})
    with pytest.raises(ValueError, match="needs calibration batches"):
        compensated.prune(model)
    assert calls == []
    compensated.prune(model, calibration=batches)
    assert calls[0][1] == {"calibration": batches, "compensate": "lsq", "ridge": 0.1}
    assert get_record(model.config) is None  # the fake removed nothing


def test_heads_only_pruner_is_head_pruner():
    model, reference = tiny_model("llama"), tiny_model("llama")
    batches = [model_inputs(seed) for seed in range(2)]
    pruner = Pruner([Part("heads", "taylor", 6, mode="uniform")], rounds=2)
    summary = pruner.prune(model, batches=batches)
    expected = HeadPruner("taylor", 6, mode="uniform", rounds=2)
    expected_summary = expected.prune(reference, batches=batches)
    assert pruner.last_selection == expected.last_selection
    assert pruner.report()["per_round"] == expected.report()["per_round"]
    assert summary.to_dict() == expected_summary.to_dict()
    reference_state = reference.state_dict()
    assert all(torch.equal(t, reference_state[k]) for k, t in model.state_dict().items())
    assert pruner.last_rounds == expected.last_rounds


def identity_blocks(model, layers: list[int]) -> list:
    """Hooks making the given blocks return their input (the reference for removing them)."""

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        return (x, *output[1:]) if isinstance(output, tuple) else x

    blocks = get_adapter(model).layers()
    return [blocks[i].register_forward_hook(hook, with_kwargs=True) for i in layers]


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_mixed_prune_equals_the_masked_reference(which):
    model = tiny_model(which)
    reference = copy.deepcopy(model)
    batches = [model_inputs(seed) for seed in range(2)]
    pruner = Pruner(
        [
            Part("layers", "block_influence", 1),
            Part("mlp", "activation", 0.25, multiple=8, criterion_options={"metric": "magnitude"}),
            Part("heads", "magnitude", 2),
        ]
    )
    pruner.prune(model, batches=batches)
    plan = pruner.last_selection
    kept = [layer for layer in range(3) if layer not in plan["layers"]]
    assert get_adapter(model).num_layers == 2
    sizes = [get_adapter(model).intermediate_size(i) for i in range(2)]
    assert sizes == [get_adapter(reference).intermediate_size(k) - len(plan["mlp"].get(k, [])) for k in kept]
    inputs = model_inputs(7)
    hooks = identity_blocks(reference, plan["layers"])
    try:
        with head_gates(reference, requires_grad=False) as heads, channel_gates(reference, requires_grad=False) as mlp:
            for layer, removed in plan["heads"].items():
                heads[layer][removed] = 0.0
            for layer, removed in plan["mlp"].items():
                mlp[layer][removed] = 0.0
            expected = model_output(reference, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(model_output(model, inputs), expected)


def test_rounds_after_layer_removal_number_heads_by_the_current_layers():
    """A model that lost a block and some heads earlier: rounds map current layers to the record's kept layers."""
    model = tiny_model("llama")
    surgery.prune(model, {"heads": {2: [0, 3]}, "layers": [1]})  # current layer 1 is original layer 2
    with torch.no_grad():  # magnitude then cuts current layer 1, where original and current numbers differ
        model.model.layers[1].self_attn.o_proj.weight.mul_(1e-3)
    record = get_record(model.config)
    kept_at_start = [record.kept_heads(layer) for layer in record.kept_layers()]
    summary = HeadPruner("magnitude", 4, rounds=2, mode="global").prune(model)
    assert summary.heads_removed == 4 and 1 in [c.layer for c in summary.layers]
    for change in summary.layers:  # "removed" is numbered as the layer was before the first round
        assert [kept_at_start[change.layer][h] for h in change.removed] == change.removed_original
