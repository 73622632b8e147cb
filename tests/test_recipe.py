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
from sinv_prune.pipeline import arm_heads
from sinv_prune.preflight import preflight
from sinv_prune.recipe import ArmSpec, RecipeError, apply_override, builtin_recipes, load_recipe, validate_recipe
from sinv_prune.selection import DEFAULT_LAYOUT, LAYOUTS

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
