"""Units as registered modules: the registry, unknown names and record keys, no unit-name tests outside
``sinv_prune/units/``, and a toy unit registered here alone running through prune, Pruner, a recipe
arm, save and reload."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import model_inputs, model_output, tiny_model

import sinv_prune
from sinv_prune.pipeline import stages
from sinv_prune.pipeline.recipe import RecipeError, validate_recipe
from sinv_prune.scoring.criteria import Criterion, get_criterion, register_criterion
from sinv_prune.scoring.criteria.registry import _CRITERIA
from sinv_prune.scoring.pruner import Part, Pruner
from sinv_prune.surgery.record import PruningRecord, get_record
from sinv_prune.units import Unit, get_unit, register_unit, unit_names, unregister_unit
from sinv_prune.units.mlp import MLP
from sinv_prune.version import __version__

ROOT = Path(sinv_prune.__file__).resolve().parent


# -- the registry ---------------------------------------------------------------------------


def test_builtin_units_are_registered_in_order():
    assert unit_names() == ("heads", "mlp", "experts", "layers")
    assert [get_unit(n).plural for n in unit_names()] == ["heads", "channels", "experts", "layers"]
    assert get_unit("layers").whole_layers and not get_unit("mlp").whole_layers


def test_unknown_unit_is_one_line_naming_it_and_the_known():
    with pytest.raises(ValueError, match=r"^unknown unit 'neurons'; choose one of heads, mlp, experts, layers$"):
        get_unit("neurons")


def test_a_taken_name_is_refused_and_unregistering_an_unknown_one_raises():
    with pytest.raises(ValueError, match="unit 'mlp' is already registered"):
        register_unit(type(MLP)())
    with pytest.raises(ValueError, match="unit 'neurons' is not registered"):
        unregister_unit("neurons")
    with pytest.raises(TypeError, match="takes a Unit instance"):
        register_unit("neurons")


# -- unknown units in a plan, a recipe, a record -----------------------------------------------


def test_unknown_unit_in_a_plan_fails_naming_it_and_leaves_the_model():
    model = tiny_model("llama")
    before = model_output(model, model_inputs())
    with pytest.raises(
        ValueError, match=r"^unknown plan keys \['neurons'\]: a plan has 'heads', 'mlp', 'experts', 'layers'$"
    ):
        sinv_prune.prune(model, {"neurons": {0: [1]}})
    assert torch.equal(model_output(model, model_inputs()), before) and get_record(model.config) is None


def test_unknown_unit_in_a_recipe_fails_naming_it():
    data = {**_recipe(), "prune": {"arms": [{"criterion": "random", "unit": "neurons", "amount": 2}]}}
    with pytest.raises(RecipeError) as err:
        validate_recipe(data)
    assert "prune.arms[0].unit" in str(err.value) and "'neurons'" in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_record_key_fails_naming_it():
    data = _record().to_json()
    data["pruned_neurons"] = {"0": [1]}
    with pytest.raises(ValueError, match=r"unknown keys \['pruned_neurons'\]") as err:
        PruningRecord.from_json(data)
    assert "\n" not in str(err.value)


def test_a_newer_records_unknown_unit_is_refused_in_one_line():
    data = {**_record().to_json(), "version": "99.0.0", "pruned_neurons": {"0": [1]}}
    with pytest.raises(ValueError, match=r"written by sinv_prune 99\.0\.0, newer than this .*upgrade") as err:
        PruningRecord.from_json(data)
    assert "pruned_neurons" in str(err.value) and "\n" not in str(err.value)
    assert PruningRecord.from_json(_record().to_json()).version == __version__  # a known record still loads


def test_a_saved_checkpoint_with_a_newer_records_unit_does_not_load(tmp_path):
    model = tiny_model("llama")
    sinv_prune.prune(model, {"mlp": {0: [1]}})
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sinv_prune"].update(version="99.0.0", pruned_neurons={"0": [1]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"written by sinv_prune 99\.0\.0.*\['pruned_neurons'\].*upgrade"):
        sinv_prune.from_pretrained(tmp_path)


# -- no unit-name tests outside sinv_prune/units/ ----------------------------------------------

_NAMES = "|".join(re.escape(n) for n in ("heads", "mlp", "experts", "layers"))
_LITERAL = rf"""["'](?:{_NAMES})["']"""
#: Comparisons with a unit name and membership tests naming one: ``== "mlp"``, ``in ("heads", ...)``.
STRING_TEST = re.compile(
    rf"[=!]=\s*{_LITERAL}|{_LITERAL}\s*[=!]=|\bin\s*[\(\[\{{][^\n]*{_LITERAL}|{_LITERAL}\s+(?:not\s+)?in\b"
)


def unit_name_tests(root: Path = ROOT) -> list[str]:
    """``path:line: code`` of every string test on a built-in unit name outside ``units/`` (comments ignored)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "units":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if STRING_TEST.search(line.split("#")[0]):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_string_test_on_a_unit_name_outside_the_units_package():
    assert unit_name_tests() == []


def test_the_grep_sees_each_form_of_test(tmp_path):
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "mlp.py").write_text('if unit == "mlp": pass\n')  # inside units/: allowed
    (tmp_path / "a.py").write_text(
        'if unit == "mlp": pass\nif "heads" != unit: pass\nif unit in ("heads", "mlp"): pass\n'
        'ok = "layers" in plan\nplan = {"heads": {}}  # "mlp" == unit in a comment\n'
    )
    assert [hit.split(":")[1] for hit in unit_name_tests(tmp_path)] == ["1", "2", "3", "4"]


# -- a toy unit, registered here alone ---------------------------------------------------------


class ChannelPairs(Unit):
    """Every other MLP channel pair: item ``j`` of a layer is channels ``2j`` and ``2j + 1``; cut as MLP channels."""

    name = "channel_pairs"
    noun = "channel pair"
    plural = "channel_pairs"
    summary_field = "mlp"
    described = "MLP channel pairs"

    def sizes(self, model):
        return [width // 2 for width in MLP.sizes(model)]

    def cost(self, model, layer):
        return 2 * MLP.cost(model, layer)

    def select(self, model, part, scores, amount, kept, exact):
        """The ``amount`` lowest-scored pairs among the layers ``kept``, every layer keeping one pair."""
        sizes = self.sizes(model)
        count = round(amount * sum(sizes[i] for i in kept)) if isinstance(amount, float) else amount
        ranked = sorted((scores[layer][j], layer, j) for layer in kept for j in range(sizes[layer] - 1))
        chosen: dict[int, list[int]] = {}
        for _, layer, j in ranked[:count]:
            chosen.setdefault(layer, []).append(j)
        return {layer: sorted(js) for layer, js in sorted(chosen.items())}

    def _channels(self, entry):
        return {layer: [c for j in pairs for c in (2 * int(j), 2 * int(j) + 1)] for layer, pairs in entry.items()}

    def validate(self, model, adapter, entry, *, allow_empty_layers=False):
        return MLP.validate(model, adapter, self._channels(entry or {}))

    def touched(self, adapter, layer):
        return MLP.touched(adapter, layer)

    def cut(self, adapter, layer, checked):
        MLP.cut(adapter, layer, checked)

    def record_cut(self, record, origin, checked):
        return MLP.record_cut(record, origin, checked)

    def original_items(self, record, adapter, layer, orig):
        return [c // 2 for c in MLP.original_items(record, adapter, layer, orig)[::2]]

    def removed(self, summary):
        return {c.layer: sorted({ch // 2 for ch in c.removed}) for c in summary.mlp}


class PairNorm(Criterion):
    """Scores a channel pair by the norm of its two down-projection columns."""

    units = ("channel_pairs",)

    def scores(self, model):
        adapter = sinv_prune.get_adapter(model)
        out = []
        for layer in range(adapter.num_layers):
            columns = adapter.mlp_out(layer).weight.detach().norm(dim=0)
            out.append(columns.view(-1, 2).sum(-1).tolist())
        return out


@pytest.fixture
def pairs():
    unit = register_unit(ChannelPairs())
    register_criterion("pair_norm")(PairNorm)
    try:
        yield unit
    finally:
        unregister_unit(unit.name)
        _CRITERIA.pop("pair_norm", None)


def _pairs_gone(model, plan: dict[int, list[int]]) -> dict[int, list[int]]:
    record = get_record(model.config)
    return {layer: sorted(record.pruned_mlp.get(layer, [])) for layer in plan}


def test_toy_unit_runs_through_prune(pairs):
    model = tiny_model("llama")
    width = sinv_prune.get_adapter(model).intermediate_size(0)
    summary = sinv_prune.prune(model, {"channel_pairs": {0: [1], 2: [0, 3]}})
    assert summary.channels_removed == 6
    assert _pairs_gone(model, {0: [], 2: []}) == {0: [2, 3], 2: [0, 1, 6, 7]}
    assert sinv_prune.get_adapter(model).intermediate_size(0) == width - 2
    with pytest.raises(ValueError, match=r"layers \[0\] are removed by the plan and also have MLP channel pairs named"):
        sinv_prune.prune(model, {"channel_pairs": {0: [1]}, "layers": [0]})  # overlap, named by the unit


def test_toy_unit_runs_through_pruner_save_and_reload(pairs, tmp_path):
    model = tiny_model("llama")
    sizes = pairs.sizes(model)
    pruner = Pruner([Part("channel_pairs", "pair_norm", 3)])
    planned = pruner.select(model)
    summary = pruner.prune(model)
    assert sum(map(len, planned["channel_pairs"].values())) == 3 and summary.channels_removed == 6
    assert pruner.last_selection == planned
    assert pruner.report()["parts"][0]["unit"] == "channel_pairs"
    assert sum(pairs.sizes(model)) == sum(sizes) - 3
    inputs = model_inputs()
    expected = model_output(model, inputs)
    model.save_pretrained(tmp_path)
    loaded = sinv_prune.from_pretrained(tmp_path)
    assert torch.allclose(model_output(loaded, inputs), expected, atol=1e-5)
    assert get_record(loaded.config).pruned_mlp == get_record(model.config).pruned_mlp


def test_toy_unit_runs_as_a_recipe_arm(pairs):
    recipe = validate_recipe({**_recipe(), "prune": {"arms": [{"criterion": "pair_norm", "unit": "channel_pairs",
                                                               "amount": 2}]}})  # fmt: skip
    arm = recipe.prune.arms[0]
    assert arm.units == ["channel_pairs"] and arm.label == "pair_norm-channel_pairs-2-global"
    pruner = stages.arm_pruner(None, arm)
    model = tiny_model("llama")
    summary = pruner.prune(model)
    assert summary.channels_removed == 4 and sum(map(len, pruner.last_selection["channel_pairs"].values())) == 2


class NamedPairs(ChannelPairs):
    """The toy unit with its own words in ``sinv-prune info`` and the Hub card (saved as MLP channels)."""

    record_field = "pruned_mlp"
    card_label = "Pairs"

    def info(self, record, layer):
        return f"  pairs gone {len(self.recorded(record).get(layer, [])) // 2}"

    def card_text(self, record):
        return f"{sum(map(len, self.recorded(record).values())) // 2} channel pairs gone"


def test_info_and_the_card_iterate_over_registered_units(tmp_path):
    from click.testing import CliRunner

    from sinv_prune.cli import main
    from sinv_prune.hub.model_card import model_card

    unit = register_unit(NamedPairs())
    try:
        model = tiny_model("gpt2")
        summary = sinv_prune.prune(model, {"channel_pairs": {0: [1, 4]}, "layers": [2]})
        model.save_pretrained(tmp_path)
        info = CliRunner().invoke(main, ["info", str(tmp_path)])
        card = model_card(model.config, repo_id="me/tiny")
        removed = {name: summary.removed(name) for name in ("channel_pairs", "layers")}
    finally:
        unregister_unit(unit.name)
    assert info.exit_code == 0, info.output
    assert "layer   0: kept   4  removed []  MLP channels kept 124/128  pairs gone 2" in info.output
    assert "layer   2: removed (the whole block)" in info.output
    assert "- **Depth, MLP and Pairs:** 1 whole blocks removed (original layers [2]); 124 to 128 of 128 MLP " in card
    assert "per remaining layer; 2 channel pairs gone." in card
    assert removed == {"channel_pairs": {0: [1, 4]}, "layers": [2]}


def test_each_unit_names_the_saved_record_field_it_writes(tmp_path):
    """The record's JSON keys stay what they were; each unit reads its own back (``recorded``) after a reload."""
    model = tiny_model("gpt2")
    plan = {"heads": {0: [1]}, "mlp": {1: [0, 5]}, "layers": [2]}
    summary = sinv_prune.prune(model, plan)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["sinv_prune"]
    record = get_record(sinv_prune.from_pretrained(tmp_path).config)
    assert "pruned_experts" not in saved  # a dense model's record is written as before experts existed
    for name in plan:
        unit = get_unit(name)
        assert {"heads": "pruned_heads", "mlp": "pruned_mlp", "layers": "removed_layers"}[name] == unit.record_field
        assert unit.to_json(unit.recorded(record)) == saved[unit.record_field] == unit.to_json(plan[name])
        assert summary.removed(name) == plan[name]


def test_a_criterion_for_the_toy_unit_is_refused_for_another(pairs):
    with pytest.raises(ValueError, match="does not score 'mlp'"):
        get_criterion("pair_norm", unit="mlp")


# -- helpers ----------------------------------------------------------------------------------


def _recipe() -> dict:
    return {
        "name": "tiny",
        "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
        "data": {"synthetic": {"num_train": 50, "num_valid": 10, "num_test": 10}, "tokenizer": {"kind": "word"}},
        "train": {"max_steps": 2},
    }


def _record() -> PruningRecord:
    return PruningRecord(
        "LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=16
    )
