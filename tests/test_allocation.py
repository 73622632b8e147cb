"""Allocation (issue 17): per-layer amounts for a target in parameters, and global channel selection."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import model_inputs, smollm2_gguf, smollm2_model, tiny_model, wikitext

from sinv_prune import Part, Pruner, count_parameters
from sinv_prune.scoring.allocation import (
    Context,
    Group,
    KLFitness,
    allocate,
    allocations,
    channel_cost,
    groups_for,
    non_embedding_parameters,
    register,
    unregister,
)
from sinv_prune.units.mlp.selection import select_channels, standardize


def _groups(rows, cost=1, multiple=1, least=1):
    out = []
    for layer, row in enumerate(rows):
        n = len(row)
        kept = [k for k in range(multiple, n, multiple) if k >= least]
        out.append(Group("mlp", layer, list(row), cost, [0] + [n - k for k in reversed(kept)]))
    return out


# FLAP by hand: layer 0 scores [1, 2, 3, 10]: mean 4, std sqrt(12.5) = 3.536, z = [-0.849, -0.566, -0.283, 1.697];
# layer 1 scores [100, 101, 102, 103]: mean 101.5, std sqrt(1.25) = 1.118, z = [-1.342, -0.447, 0.447, 1.342].
# Removing 3 of 8 by the lowest z: layer 1's channel 0 (-1.342), layer 0's channels 0 and 1 (-0.849, -0.566),
# so FLAP's per-layer ratios are 2/4 and 1/4. Raw scores would take all three from layer 0.
FLAP_ROWS = [[1.0, 2.0, 3.0, 10.0], [100.0, 101.0, 102.0, 103.0]]


def test_standardized_reproduces_flap_per_layer_ratios_by_hand():
    groups = _groups(FLAP_ROWS, cost=7)
    found = allocate("standardized", groups, 3 * 7)
    assert found.counts == {("mlp", 0): 2, ("mlp", 1): 1}  # ratios 0.5 and 0.25
    assert [g.pick(found.counts["mlp", g.layer]) for g in groups] == [[0, 1], [0]]
    assert found.removed == found.target == 21


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_standardized_puts_heads_and_channels_on_one_scale_by_parameter_cost(seed):
    """The knapsack's plan is the brute-force one: the most parameters <= target, then the least sum of
    (standardised score x parameters) over the removed heads and channels."""
    import itertools
    import random

    from sinv_prune.arch import get_adapter
    from sinv_prune.scoring.allocation import standardized_curves

    lay = get_adapter(tiny_model("llama", num_hidden_layers=1)).layout(0)  # 6 query heads in 2 KV groups
    rng = random.Random(seed)
    groups = [
        Group("heads", 0, [rng.random() for _ in range(6)], 12, [0, 2, 4], lay),
        Group("heads", 1, [rng.random() for _ in range(6)], 12, [0, 2, 4], lay),
        Group("mlp", 0, [rng.random() for _ in range(8)], 5, list(range(7))),
        Group("mlp", 1, [rng.random() ** 3 for _ in range(8)], 5, list(range(7))),
    ]
    target = 61
    curves = standardized_curves(groups)
    best = min(
        (-sum(k * g.cost for k, g in zip(combo, groups, strict=True)),
         sum(c[g.allowed.index(k)] for k, g, c in zip(combo, groups, curves, strict=True)), combo)
        for combo in itertools.product(*(g.allowed for g in groups))
        if sum(k * g.cost for k, g in zip(combo, groups, strict=True)) <= target
    )  # fmt: skip
    found = allocate("standardized", groups, target)
    assert tuple(found.counts[g.unit, g.layer] for g in groups) == best[2]
    # a head's z-score counts once per parameter: its curve is the removed heads' z-sum times 12
    z = standardize(groups[0].scores)
    assert curves[0][1] == pytest.approx(12 * sum(z[h] for h in groups[0].pick(2, z)))


def test_global_channels_are_standardised_and_keep_a_quarter():
    """The blow-up case on a small scale: one layer's scores 1000x smaller no longer takes the whole cut."""
    rows = [[x * 1e-3 for x in range(1, 17)], [float(x) for x in range(1, 17)], [float(x) for x in range(1, 17)]]
    chosen = select_channels([16, 16, 16], rows, 12)
    assert sorted(len(chosen.get(layer, [])) for layer in range(3)) == [4, 4, 4]
    # A layer keeps a quarter of its width by default, unless the arm asks for less.
    skewed = [[0.0] * 15 + [1.0], [float(x) for x in range(16)], [float(x) for x in range(16)]]
    kept = {layer: 16 - len(c) for layer, c in select_channels([16] * 3, skewed, 30).items()}
    assert min(kept.values()) >= 4
    less = select_channels([16] * 3, skewed, 30, min_channels_per_layer=1)
    assert sum(map(len, less.values())) == 30


@pytest.mark.parametrize("strategy", ["standardized", "sensitivity", "search"])
def test_each_allocation_meets_the_parameter_target_exactly(strategy):
    model = tiny_model("llama", num_hidden_layers=4)
    batches = [model_inputs(i, batch=2, length=12) for i in range(2)]
    options = {"budget": 6} if strategy == "search" else None
    part = Part("mlp", "activation", {"params": 0.1}, allocation=strategy, allocation_options=options)
    pruner = Pruner([part])
    pruner.quiet = True
    target = math.floor(0.1 * non_embedding_parameters(model))
    cost = channel_cost(model, 0)
    summary = pruner.prune(model, batches=batches)
    assert summary.params_before - summary.params_after == target // cost * cost
    assert pruner.last_allocation[0]["removed_params"] == target // cost * cost
    assert pruner.report()["allocations"][0]["strategy"] == strategy


def test_an_unreachable_target_removes_the_nearest_below_with_a_warning(caplog):
    groups = _groups(FLAP_ROWS, cost=10, multiple=2)  # a layer loses 0 or 2 channels: 20 parameters a step
    with caplog.at_level(logging.WARNING):
        found = allocate("standardized", groups, 35)
    assert found.removed == 20 and "35 parameters targeted, 20 removed" in caplog.text
    with pytest.raises(ValueError, match="nearest achievable"):
        allocate("standardized", groups, 35, exact=True)
    with pytest.raises(ValueError, match="more than the 40 the constraints let go"):
        allocate("standardized", groups, 45)


def test_search_is_deterministic_per_seed_and_never_worse_than_its_seed():
    model = tiny_model("llama", num_hidden_layers=4)
    batches = [model_inputs(i, batch=2, length=12) for i in range(2)]
    scores = [[float(x) for x in torch.randn(64, generator=torch.Generator().manual_seed(i))] for i in range(4)]
    groups = groups_for(model, "mlp", scores, range(4), min_per_layer=None, multiple=4)
    target = 40 * groups[0].cost
    runs = [allocate("search", groups, target, Context(model, batches, seed=s, options={"budget": 12}, quiet=True))
            for s in (0, 0, 1)]  # fmt: skip
    assert runs[0].counts == runs[1].counts
    seed_plan = allocate("standardized", groups, target)
    with KLFitness(model, groups, batches) as fitness:
        seed_fit = fitness([seed_plan.counts[g.unit, g.layer] for g in groups])
        for found in runs:
            best = fitness([found.counts[g.unit, g.layer] for g in groups])
            assert best <= seed_fit + 1e-12
            assert found.details["search"]["seed_fitness"] == pytest.approx(seed_fit)
            assert found.removed == seed_plan.removed
    assert not model.model.layers[0].mlp.down_proj._forward_pre_hooks  # the gates are gone


def test_sensitivity_measures_each_layer_and_prefers_the_robust_one():
    """Channels of a layer whose down projection is scaled to near zero cost nothing: that layer takes the cut."""
    model = tiny_model("llama", num_hidden_layers=3)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e-4)
    batches = [model_inputs(i, batch=2, length=12) for i in range(2)]
    part = Part("mlp", "magnitude", 48, allocation="sensitivity")
    pruner = Pruner([part])
    pruner.quiet = True
    plan = pruner.select(model, batches=batches)
    assert len(plan["mlp"][1]) == 48  # a quarter of 64 stays
    assert set(plan["mlp"]) == {1}


def test_allocation_errors_are_one_line():
    with pytest.raises(ValueError, match="unknown allocation 'best'"):
        Part("mlp", "magnitude", 0.1, allocation="best")
    with pytest.raises(ValueError, match="leave mode|mode must be 'global'"):
        Part("mlp", "magnitude", 0.1, allocation="standardized", mode="uniform")
    with pytest.raises(ValueError, match="takes no option"):
        Part("mlp", "magnitude", 0.1, allocation="standardized", allocation_options={"budget": 3})
    with pytest.raises(ValueError, match="params"):
        Part("mlp", "magnitude", {"parameters": 0.1})
    with pytest.raises(ValueError, match="needs calibration batches"):
        Pruner([Part("mlp", "magnitude", 0.1, allocation="search")]).select(tiny_model("llama"))


@pytest.fixture
def last_layers_first():
    """A toy strategy registered while the test runs: it takes the whole target from the last layers."""
    seen = {}

    @register("last_layers_first", options=("note",))
    def strategy(groups, target, context):
        seen["options"] = dict(context.options)
        counts = [0] * len(groups)
        for i in reversed(range(len(groups))):
            counts[i] = max((k for k in groups[i].allowed if k * groups[i].cost <= target), default=0)
            target -= counts[i] * groups[i].cost
        return counts

    yield seen
    unregister("last_layers_first")
    assert "last_layers_first" not in allocations()


def test_a_registered_strategy_is_accepted_by_part_pruner_and_recipe(last_layers_first):
    from test_pipeline import TINY

    from sinv_prune.pipeline.recipe import validate_recipe

    assert allocations()[-1] == "last_layers_first"
    model = tiny_model("llama", num_hidden_layers=3)
    part = Part("mlp", "magnitude", 10, allocation="last_layers_first", allocation_options={"note": 1})
    plan = Pruner([part]).select(model)
    assert list(plan["mlp"]) == [2] and len(plan["mlp"][2]) == 10
    assert last_layers_first["options"] == {"note": 1}
    with pytest.raises(ValueError, match=r"allocation 'last_layers_first' takes no option\(s\) \['budget'\]"):
        Part("mlp", "magnitude", 10, allocation="last_layers_first", allocation_options={"budget": 1})
    arm = {"unit": "mlp", "criterion": "magnitude", "amount": 8, "allocation": "last_layers_first"}
    recipe = validate_recipe({**TINY, "prune": {"arms": [arm]}})
    assert recipe.prune.arms[0].part_specs[0].allocation == "last_layers_first"
    with pytest.raises(Exception, match="unknown allocation 'first_layers_first'; choose one of uniform, "):
        validate_recipe({**TINY, "prune": {"arms": [{**arm, "allocation": "first_layers_first"}]}})


def test_register_refuses_taken_and_malformed_names(last_layers_first):
    for name in ("uniform", "search", "last_layers_first", "Bad-Name"):
        with pytest.raises(ValueError, match="already registered|lower snake case"):
            register(name)
    with pytest.raises(ValueError, match="'nothing' is not registered"):
        unregister("nothing")


def _gate_hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_kl_fitness_leaves_no_gates_however_its_block_ends(monkeypatch):
    from sinv_prune.scoring import allocation

    model = tiny_model("llama", num_hidden_layers=3).train()
    batches = [model_inputs(0, batch=2, length=8)]
    groups = groups_for(model, "mlp", [[1.0] * 64] * 3, range(3), min_per_layer=None)
    assert _gate_hooks(model) == 0
    with pytest.raises(RuntimeError, match="boom"), KLFitness(model, groups, batches) as fitness:
        assert _gate_hooks(model) > 0 and not model.training
        fitness([0, 1, 2])
        raise RuntimeError("boom")
    assert _gate_hooks(model) == 0 and model.training
    bad = [{"input_ids": torch.full((1, 4), 10_000)}]  # the reference forward fails inside __enter__
    with pytest.raises(IndexError), KLFitness(model, groups, bad):
        pass
    assert _gate_hooks(model) == 0 and model.training

    def fail(*args):
        raise RuntimeError("mutation failed")

    monkeypatch.setattr(allocation, "_mutate", fail)  # a failure in the middle of the search
    with pytest.raises(RuntimeError, match="mutation failed"):
        allocate("search", groups, 8 * groups[0].cost, Context(model, batches, options={"budget": 4}, quiet=True))
    assert _gate_hooks(model) == 0 and model.training


def test_params_amount_works_for_the_selection_modes_too():
    model = tiny_model("llama", num_hidden_layers=4)
    target = math.floor(0.2 * non_embedding_parameters(model))
    before = count_parameters(model)
    Pruner([Part("mlp", "magnitude", {"params": 0.2}, mode="uniform")]).prune(model)
    removed = before - count_parameters(model)
    assert removed <= target and removed > target - 4 * channel_cost(tiny_model("llama"), 0)


@pytest.mark.real
@pytest.mark.slow
def test_global_magnitude_no_longer_starves_smollm2_layers():
    """Issue 17's case: global Wanda on SmolLM2's MLP at -10% (6240 channels) left a layer 141 of 1536 channels."""
    import transformers

    gguf = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(wikitext("valid")[:4000], return_tensors="pt").input_ids[:, :128]
    model = smollm2_model()
    part = Part("mlp", "activation", 6240, criterion_options={"metric": "magnitude"})
    scores = part.criterion.compute(model, [{"input_ids": ids}])
    kept = [1536 - len(c) for c in (select_channels(model, scores, 6240).get(i, []) for i in range(30))]
    assert sum(1536 - k for k in kept) == 6240 and min(kept) >= 384
    raw = select_channels(model, scores, 6240, mode="per_layer")  # the other modes are unchanged
    assert sum(map(len, raw.values())) == 6240


ISSUE_ARM = {"unit": "mlp", "criterion": "activation", "options": {"metric": "magnitude"}, "amount": {"params": 0.10},
             "compensate": {"method": "lsq", "batches": 16}}  # fmt: skip


def test_the_issue_arm_validates_for_every_allocation():
    from test_pipeline import TINY

    from sinv_prune.pipeline.recipe import validate_recipe

    arms = [{**ISSUE_ARM, "allocation": a} for a in ("search", "standardized", "sensitivity")]
    recipe = validate_recipe({**TINY, "prune": {"arms": arms}})
    assert [a.label for a in recipe.prune.arms] == [
        f"activation-mlp-p0.1-{a}-lsq" for a in ("search", "standardized", "sensitivity")
    ]
    bad = [{**ISSUE_ARM, "allocation": "search", "mode": "uniform"}]
    with pytest.raises(Exception, match="leave mode at global"):
        validate_recipe({**TINY, "prune": {"arms": bad}})
    with pytest.raises(Exception, match="takes no option"):
        validate_recipe({**TINY, "prune": {"arms": [{**ISSUE_ARM, "allocation": "standardized",
                                                     "allocation_options": {"budget": 2}}]}})  # fmt: skip


def test_the_issue_arm_runs_end_to_end_and_records_its_allocation(tmp_path):
    import json

    from test_pipeline import TINY, invoke, recipe_file

    arms = [{**ISSUE_ARM, "allocation": "search", "allocation_options": {"budget": 4}},
            {**ISSUE_ARM, "allocation": "sensitivity", "compensate": {"method": "lsq", "batches": 2}}]  # fmt: skip
    data = {**TINY, "train": {"max_steps": 2, "batch_size": 8, "learning_rate": 0.003}, "prune": {"arms": arms},
            "evaluate": {"speed": False}}  # fmt: skip
    data.pop("finetune")
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for arm, strategy in zip(results["arms"], ("search", "sensitivity"), strict=True):
        assert arm["allocation_strategy"] == strategy and arm["channels_removed"] > 0
        found = arm["allocation"][0]
        assert found["strategy"] == strategy and found["removed_params"] <= found["target_params"]
        assert found["removed_params"] == results["baseline"]["params"] - arm["params"]
        assert found["kept"]["mlp"]["min"] <= found["kept"]["mlp"]["max"] <= 128
    assert "search" in results["arms"][0]["allocation"][0]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "allocation `search`" in report and "mlp kept" in report


def test_a_params_target_beyond_the_constraints_exits_2_before_any_output(tmp_path):
    from test_pipeline import TINY, invoke, recipe_file

    arm = {**ISSUE_ARM, "amount": {"params": 0.9}, "allocation": "standardized"}
    result = invoke(recipe_file(tmp_path, {**TINY, "prune": {"arms": [arm]}}), "--output", tmp_path / "out")
    assert result.exit_code == 2 and "prune.arms[0].amount" in result.output
    assert "the constraints let at most" in result.output and not (tmp_path / "out").exists()
