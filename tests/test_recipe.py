"""Recipe validation: every kind of bad input fails before any work, naming the key path."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import get_args

import pytest
import yaml
from click.testing import CliRunner
from conftest import tiny_model

from sinv_prune.cli import main
from sinv_prune.pipeline.preflight import preflight
from sinv_prune.pipeline.recipe import (
    ArmSpec,
    RecipeError,
    apply_override,
    builtin_recipes,
    load_recipe,
    validate_recipe,
)
from sinv_prune.pipeline.stages import arm_heads
from sinv_prune.units.heads.selection import DEFAULT_LAYOUT, LAYOUTS

GOOD = {
    "name": "tiny",
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
    "data": {"synthetic": {"num_train": 50, "num_valid": 10, "num_test": 10}, "tokenizer": {"kind": "word"}},
    "train": {"max_steps": 2},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 2}, {"criterion": "random", "amount": 0.25}]},
}


def write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def with_change(path: str, value):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    apply_override(data, f"{path}={yaml.safe_dump(value, default_flow_style=True).strip()}")
    return data


def test_good_recipe_loads_and_passes_preflight(tmp_path):
    recipe = load_recipe(write(tmp_path, GOOD))
    assert [a.label for a in recipe.prune.arms] == ["magnitude-2-global", "random-0.25-global"]
    layouts = preflight(recipe)
    assert [lay.num_heads for lay in layouts] == [4, 4]


@pytest.mark.parametrize(
    ("change", "value", "message"),
    [
        ("prune.arms[1].amount", "lots", "prune.arms[1].amount"),
        ("prune.arms[0].amount", -1, "prune.arms[0].amount: amount must be a positive"),
        ("prune.arms[0].colour", "red", "prune.arms[0].colour: unknown key"),
        ("model.architecture", "t5", "model.architecture: unknown architecture 't5'"),
        ("data.seq_len", "long", "data.seq_len"),
        ("train", None, "recipe: a model built from scratch needs a 'train' stage"),
        ("prune.arms", [], "prune.arms"),
        ("data.hub", {"path": "wikitext"}, "data: give exactly one data source"),
        ("prune.arms[0].layout", "groups", "prune.arms[0].layout: Input should be 'q_per_group', 'kv_groups' or"),
    ],
)
def test_schema_errors_name_the_key_path(change, value, message):
    with pytest.raises(RecipeError, match="^" + message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        validate_recipe(with_change(change, value))


@pytest.mark.parametrize(
    ("change", "value", "message"),
    [
        ("prune.arms[0].criterion", "vibes", r"prune.arms\[0\].criterion: .*vibes.*magnitude"),
        ("prune.arms[0].amount", 9, r"prune.arms\[0\].amount: 9 heads requested, the model has 8"),
        ("prune.arms[0].min_heads_per_layer", 4, r"prune.arms\[0\].amount"),
    ],
)
def test_preflight_errors_name_the_key_path(change, value, message):
    with pytest.raises(RecipeError, match=message):
        preflight(validate_recipe(with_change(change, value)))


def test_gqa_request_that_cannot_be_met():
    data = with_change("model", {"architecture": "llama", "config": {
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48,
        "head_dim": 8, "intermediate_size": 64}})  # fmt: skip
    apply_override(data, "prune.arms[0].mode=uniform")
    apply_override(data, "prune.arms[0].amount=3")  # 3 per model = 1.5 per layer: impossible uniformly
    with pytest.raises(RecipeError, match=r"prune.arms\[0\].amount"):
        preflight(validate_recipe(data))


LLAMA = {"architecture": "llama", "config": {
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48,
    "head_dim": 8, "intermediate_size": 64}}  # fmt: skip


def test_arm_layout_reaches_the_selection():
    """A recipe arm's layout decides the cut: one query head per group by default, whole groups on request."""
    data = with_change("model", LLAMA)
    data["prune"]["arms"] = [{"criterion": "magnitude", "amount": 4, "mode": "uniform"},
                             {"criterion": "magnitude", "amount": 6, "mode": "uniform", "layout": "kv_groups"},
                             {"criterion": "magnitude", "amount": 6, "mode": "uniform", "layout": "auto"}]  # fmt: skip
    recipe = validate_recipe(data)
    assert [a.label for a in recipe.prune.arms] == [
        "magnitude-4-uniform", "magnitude-6-uniform-kv_groups", "magnitude-6-uniform-auto"]  # fmt: skip
    preflight(recipe)
    group_alike = [[float(h // 3) + 0.01 * h for h in range(6)] for _ in range(2)]  # a whole group is cheapest
    run = SimpleNamespace(base=tiny_model("llama", num_hidden_layers=2))
    heads = [arm_heads(run, arm, {"magnitude": {"scores": group_alike}}) for arm in recipe.prune.arms]
    assert heads[0] == {0: [0, 3], 1: [0, 3]}  # q_per_group: the weakest head of each group
    assert heads[1] == heads[2] == {0: [0, 1, 2], 1: [0, 1, 2]}  # the weaker group


def test_layout_that_cannot_meet_the_amount_is_named():
    data = with_change("model", LLAMA)
    apply_override(data, "prune.arms[0]={criterion: magnitude, amount: 3, mode: uniform, layout: kv_groups}")
    with pytest.raises(RecipeError, match=r"prune.arms\[0\].amount: .*layout 'kv_groups'"):
        preflight(validate_recipe(data))


def test_recipe_layouts_match_the_selection():
    assert get_args(ArmSpec.model_fields["layout"].annotation) == LAYOUTS
    assert ArmSpec.model_fields["layout"].default == DEFAULT_LAYOUT


def test_empty_layers_need_allow_empty_layers(tmp_path):
    data = with_change("prune.arms[1].min_heads_per_layer", 0)
    message = "prune.arms[1].min_heads_per_layer: 0 lets layers lose every head; set prune.allow_empty_layers: true"
    with pytest.raises(RecipeError, match="^" + re.escape(message)):
        preflight(validate_recipe(data))
    result = CliRunner().invoke(main, [str(write(tmp_path, data)), "--output", str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + message)
    assert not (tmp_path / "out").exists()
    data["prune"]["allow_empty_layers"] = True
    preflight(validate_recipe(data))


def test_missing_data_file_is_named(tmp_path):
    data = with_change("data", {"files": {"test": "nowhere.txt"}, "tokenizer": {"kind": "word"}})
    recipe = load_recipe(write(tmp_path, data))
    with pytest.raises(RecipeError, match=r"data.files.test: .*nowhere.txt does not exist"):
        preflight(recipe)


def test_malformed_yaml_and_non_mapping(tmp_path):
    with pytest.raises(RecipeError, match="malformed YAML at line 2"):
        load_recipe(write(tmp_path, "name: x\n  bad: [unclosed\n"))
    with pytest.raises(RecipeError, match="a recipe is a YAML mapping"):
        load_recipe(write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "absent.yaml")


def test_overrides_set_nested_keys_and_list_items(tmp_path):
    recipe = load_recipe(write(tmp_path, GOOD), ["prune.arms[0].amount=3", "train.learning_rate=0.01", "seed=7"])
    assert recipe.prune.arms[0].amount == 3
    assert recipe.train.learning_rate == 0.01
    assert recipe.seed == 7
    with pytest.raises(RecipeError, match="no list item"):
        load_recipe(write(tmp_path, GOOD), ["prune.arms[5].amount=3"])
    with pytest.raises(RecipeError, match="expected key.path=value"):
        load_recipe(write(tmp_path, GOOD), ["seed"])


def test_shipped_recipes_validate():
    names = builtin_recipes()
    assert {"quickstart", "nn6-wikitext2", "smollm2-wikitext2"} <= set(names)
    for path in names.values():
        load_recipe(path)


# -- what an arm removes: unit, parts --------------------------------------------------------------


def registered(name: str, units: tuple[str, ...]):
    """A criterion registered as ``name`` for ``units`` while the test runs (real ones declare theirs)."""
    from sinv_prune.scoring.criteria import Criterion, register_criterion
    from sinv_prune.scoring.criteria.registry import _CRITERIA

    register_criterion(name)(type(name, (Criterion,), {"units": units}))
    yield name
    _CRITERIA.pop(name)


@pytest.fixture
def any_unit_criterion():
    yield from registered("test_any_unit", ("heads", "mlp", "layers"))


@pytest.fixture
def heads_only_criterion():
    yield from registered("test_heads_only", ("heads",))


MIXED = {"parts": [{"criterion": "magnitude", "amount": 2},
                   {"criterion": "taylor", "unit": "mlp", "amount": 0.25, "mode": "uniform", "multiple": 8}],
         "compensate": {"method": "bias"}}  # fmt: skip


def test_arm_labels_name_what_they_remove():
    arms = [{"criterion": "magnitude", "amount": 2},
            {"criterion": "taylor", "unit": "mlp", "amount": 0.25, "mode": "uniform", "multiple": 64},
            {"criterion": "taylor", "unit": "layers", "amount": 1},
            MIXED]  # fmt: skip
    recipe = validate_recipe(with_change("prune.arms", arms))
    assert [a.label for a in recipe.prune.arms] == [
        "magnitude-2-global",
        "taylor-mlp-0.25-uniform",
        "taylor-layers-1-global",
        "magnitude-heads-2-global+taylor-mlp-0.25-uniform-bias",
    ]
    assert [a.units for a in recipe.prune.arms] == [["heads"], ["mlp"], ["layers"], ["heads", "mlp"]]
    mixed = recipe.prune.arms[3]
    assert [p.unit for p in mixed.part_specs] == ["heads", "mlp"] and mixed.part_specs[1].multiple == 8
    assert mixed.criterion is None and mixed.criterion_names == "magnitude+taylor" and not mixed.heads_only


@pytest.mark.parametrize(
    ("arm", "message"),
    [
        ({"criterion": "taylor", "unit": "neurons", "amount": 2}, "prune.arms[0].unit: Input should be 'heads'"),
        ({"criterion": "taylor", "unit": "mlp", "amount": 2, "layout": "kv_groups"},
         "prune.arms[0]: 'layout' is for unit heads only, not mlp"),
        ({"criterion": "taylor", "unit": "layers", "amount": 1, "min_heads_per_layer": 0},
         "prune.arms[0]: 'min_heads_per_layer' is for unit heads only, not layers"),
        ({"criterion": "taylor", "amount": 2, "multiple": 8}, "prune.arms[0]: 'multiple' is for unit mlp only"),
        ({"criterion": "taylor", "unit": "layers", "amount": 1, "min_channels_per_layer": 4},
         "'min_channels_per_layer' is for unit mlp only, not layers"),
        ({"criterion": "taylor", "unit": "layers", "amount": 1, "mode": "uniform"},
         "prune.arms[0]: unit layers takes mode 'global' only, not 'uniform'"),
        ({"criterion": "taylor", "unit": "mlp", "amount": 1.5}, "prune.arms[0].amount: a fractional amount"),
        ({**MIXED, "criterion": "taylor"}, "prune.arms[0]: give either 'parts' or the single-part keys, not both"),
        ({"parts": []}, "prune.arms[0].parts: List should have at least 1 item"),
        ({"parts": [{"criterion": "taylor", "unit": "mlp", "amount": 2, "layout": "auto"}]},
         "prune.arms[0].parts[0]: 'layout' is for unit heads only, not mlp"),
        ({"parts": [{"criterion": "taylor", "amount": -2}]}, "prune.arms[0].parts[0].amount: amount must be"),
        ({"unit": "mlp", "amount": 2}, "prune.arms[0]: missing 'criterion' (or give 'parts')"),
        ({"criterion": "taylor", "unit": "mlp", "amount": {"params": 0.1}, "allocation": "search", "rounds": 2},
         "prune.arms[0]: rounds: 2 re-select each round with the arm's mode; allocation 'search' decides the whole "
         "cut at once (rounds: 1)"),
    ],
)  # fmt: skip
def test_arm_units_and_parts_are_validated(arm, message):
    with pytest.raises(RecipeError) as err:
        validate_recipe(with_change("prune.arms", [arm]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_criterion_must_score_the_unit(heads_only_criterion):
    arms = [{"criterion": "magnitude", "amount": 2},
            {"parts": [{"criterion": "magnitude", "amount": 2},
                       {"criterion": heads_only_criterion, "unit": "mlp", "amount": 4}]}]  # fmt: skip
    with pytest.raises(RecipeError, match=r"^prune.arms\[1\].parts\[1\].unit: criterion 'test_heads_only' scores "
                                          r"heads, not mlp$"):  # fmt: skip
        preflight(validate_recipe(with_change("prune.arms", arms)))


LLAMA_MLP = {"architecture": "llama", "config": {"num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 48}}  # fmt: skip


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"unit": "mlp", "amount": 95}, "95 MLP channels requested, at most 94 can go (96 in 2 layers, 1 kept "
                                        "per layer)"),
        ({"unit": "mlp", "amount": 90, "min_channels_per_layer": 4}, "at most 88 can go"),
        ({"unit": "layers", "amount": 2}, "2 layers requested, the model has 2 (one must stay)"),
        ({"amount": 9}, "9 heads requested, the model has 8"),
        ({"amount": 3, "mode": "uniform"}, "layout 'q_per_group'"),
    ],
)  # fmt: skip
def test_every_unit_amount_is_checked_from_the_config(any_unit_criterion, part, message):
    """Amounts for heads, MLP channels and layers fail in preflight (meta weights), naming the part's key."""
    arms = [{"criterion": "magnitude", "amount": 2},
            {"parts": [{"criterion": any_unit_criterion, "amount": 2},
                       {"criterion": any_unit_criterion, **part}]}]  # fmt: skip
    recipe = validate_recipe({**with_change("prune.arms", arms), "model": LLAMA_MLP})
    with pytest.raises(RecipeError) as err:
        preflight(recipe)
    assert str(err.value).startswith("prune.arms[1].parts[1].amount: ") and message in str(err.value)


def test_amounts_the_model_can_meet_pass(any_unit_criterion):
    arms = [{"criterion": any_unit_criterion, "unit": "mlp", "amount": 94},
            {"criterion": any_unit_criterion, "unit": "mlp", "amount": 0.5, "mode": "uniform"},
            {"criterion": any_unit_criterion, "unit": "layers", "amount": 1},
            {"parts": [{"criterion": any_unit_criterion, "amount": 4},  # one query head per KV group
                       {"criterion": any_unit_criterion, "unit": "layers", "amount": 0.5}]}]  # fmt: skip
    assert len(preflight(validate_recipe({**with_change("prune.arms", arms), "model": LLAMA_MLP}))) == 2


def test_the_resolved_recipe_of_unit_and_mixed_arms_loads_again(tmp_path):
    """recipe.yaml repeats every default (layout on an MLP arm, unit on a mixed one): it must still validate."""
    from sinv_prune.pipeline.recipe import recipe_to_yaml

    arms = [{"criterion": "taylor", "unit": "mlp", "amount": 0.25, "multiple": 8}, MIXED]
    recipe = validate_recipe(with_change("prune.arms", arms))
    again = load_recipe(write(tmp_path, recipe_to_yaml(recipe)))
    assert [a.label for a in again.prune.arms] == [a.label for a in recipe.prune.arms]
    assert again.prune.arms[1].part_specs == recipe.prune.arms[1].part_specs
