"""A part's amount: one set of bounds for ``Part`` and the recipe, one check that a (meta) model can meet it."""

from __future__ import annotations

import re

import pytest

from sinv_prune.pipeline.preflight import preflight
from sinv_prune.pipeline.recipe import RecipeError, validate_recipe
from sinv_prune.pipeline.starting_model import meta_adapter
from sinv_prune.scoring.amounts import PARAMS_SHARE
from sinv_prune.scoring.pruner import Part


def _recipe(arm: dict) -> dict:
    return {
        "name": "tiny",
        "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
        "data": {"synthetic": {"num_train": 50, "num_valid": 10, "num_test": 10}, "tokenizer": {"kind": "word"}},
        "train": {"max_steps": 2},
        "prune": {"arms": [arm]},
    }


@pytest.mark.parametrize("share", [0, 0.0, 1, 1.0, -0.25, 1.5])
def test_part_and_recipe_refuse_the_same_shares_with_the_same_message(share):
    message = f"{PARAMS_SHARE}, got {share:g}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Part("mlp", "random", {"params": share})
    with pytest.raises(RecipeError, match=f"^prune.arms\\[0\\].amount: {re.escape(message)}$"):
        validate_recipe(_recipe({"criterion": "random", "unit": "mlp", "amount": {"params": share}}))


def test_a_share_that_is_no_number_is_refused_naming_it():
    with pytest.raises(ValueError, match=f"^{re.escape(PARAMS_SHARE)}, got 'half'$"):
        Part("mlp", "random", {"params": "half"})


def test_a_share_inside_the_bounds_is_taken_by_both():
    assert Part("mlp", "random", {"params": 0.25}).amount == {"params": 0.25}
    recipe = validate_recipe(_recipe({"criterion": "random", "unit": "mlp", "amount": {"params": 0.25}}))
    assert recipe.prune.arms[0].amount == {"params": 0.25}


@pytest.mark.parametrize(
    ("arm", "part", "message"),
    [
        ({"criterion": "random", "amount": 9}, Part("heads", "random", 9), "9 heads requested, the model has 8"),
        (
            {"criterion": "random", "unit": "mlp", "amount": {"params": 0.9}, "allocation": "standardized"},
            Part("mlp", "random", {"params": 0.9}, allocation="standardized"),
            "the constraints let at most",
        ),
        (
            {"criterion": "random", "unit": "layers", "amount": {"params": 0.01}},
            Part("layers", "random", {"params": 0.01}),
            "0.01 of the parameters is less than one layer",
        ),
    ],
)
def test_preflight_and_part_run_the_one_check_on_a_meta_model(arm, part, message):
    recipe = validate_recipe(_recipe(arm))
    with pytest.raises(RecipeError, match=f"^prune.arms\\[0\\].amount: .*{re.escape(message)}") as preflight_error:
        preflight(recipe)
    with pytest.raises(ValueError, match=re.escape(message)) as part_error:
        part.check_met(meta_adapter(recipe).model)
    assert str(preflight_error.value) == f"prune.arms[0].amount: {part_error.value}"


def test_a_part_the_model_can_meet_passes_the_check():
    recipe = validate_recipe(_recipe({"criterion": "random", "amount": 2}))
    Part("heads", "random", 2, mode="uniform").check_met(meta_adapter(recipe).model)
    Part("mlp", "random", {"params": 0.1}, allocation="standardized").check_met(meta_adapter(recipe).model)
