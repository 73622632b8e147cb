"""HeadPruner end to end: the pruned model computes what the gated (masked) original computes."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
import yaml
from conftest import model_inputs, model_output, tiny_model

from sinv_prune import head_gates, head_measures
from sinv_prune.criteria import Criterion, RandomCriterion
from sinv_prune.pruner import HeadPruner
from sinv_prune.recipe import validate_recipe
from sinv_prune.selection import model_layouts


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

    assert summary.heads_removed == sum(map(len, pruner.last_selection.values())) > 0
    assert summary.params_after < summary.params_before
    inputs = model_inputs(7)
    torch.testing.assert_close(model_output(model, inputs), masked_output(reference, pruner.last_selection, inputs))
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
    assert pruner.last_selection == {1: [3, 4, 5]}
    assert pruner.report()["criterion_report"]["crossed"] == 3


def test_criterion_by_name_instance_and_seed():
    model = tiny_model("gpt2")
    assert HeadPruner("random", 3, seed=5).criterion.seed == 5
    assert HeadPruner("random", 3, seed=5, criterion_options={"seed": 1}).criterion.seed == 1
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
    assert pruner.last_selection == {1: [0, 1, 2, 3]}
    inputs = model_inputs(3)
    torch.testing.assert_close(model_output(model, inputs), masked_output(reference, pruner.last_selection, inputs))


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
    assert pruner.report()["layout"] == (layout or "q_per_group")
    assert f"layout={pruner.layout!r}" in repr(pruner)


def test_docstring_recipe_is_a_valid_arm_of_the_example():
    """The YAML in HeadPruner's docstring parses with the recipe schema and says what its Python example says."""
    doc = textwrap.dedent(HeadPruner.__doc__.split("\n", 1)[1])
    block = doc.split(".. code-block:: yaml", 1)[1]
    fragment = yaml.safe_load(textwrap.dedent(block))
    recipe = validate_recipe({"model": {"path": "some/model"}, "data": {"synthetic": {}}, **fragment})
    (arm,) = recipe.prune.arms
    example = next(line for line in doc.splitlines() if line.startswith(">>> pruner = "))
    pruner = eval(example.split("=", 1)[1], {"HeadPruner": HeadPruner})  # noqa: S307 - our own docstring
    assert (arm.criterion, arm.amount, arm.mode, arm.layout, arm.min_heads_per_layer) == (
        pruner.criterion.name,
        pruner.amount,
        pruner.mode,
        pruner.layout,
        pruner.min_heads_per_layer,
    )
