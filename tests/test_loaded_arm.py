"""A ``pruned: DIR`` arm: a checkpoint pruned earlier, fine-tuned and evaluated beside a control in a new run."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_pipeline import TINY

import sinv_prune
from sinv_prune.cli import main

FIRST = {
    **TINY,
    "name": "first",
    "train": {"max_steps": 6, "batch_size": 8, "learning_rate": 0.003},
    "prune": {
        "arms": [
            {
                "parts": [
                    {"criterion": "magnitude", "amount": 2},
                    {"criterion": "magnitude", "unit": "mlp", "amount": 32},
                ]
            }
        ]
    },  # fmt: skip
    "finetune": None,
    "evaluate": {"speed": False, "prompts": []},
}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def write(path, recipe):
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first")
    result = invoke(write(tmp / "first.yaml", FIRST), "--output", tmp / "out", "--quiet")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp / "out" / "results.json").read_text())
    return tmp / "out", results["arms"][0]


def second(first_dir, arms) -> dict:
    """A run on the first run's trained base model (its own tokenizer), fine-tuning briefly."""
    return {**FIRST, "name": "second", "model": {"path": str(first_dir / "base")}, "train": None,
            "data": {**FIRST["data"], "tokenizer": {"kind": "model"}}, "prune": {"arms": arms},
            "finetune": {"max_steps": 2, "batch_size": 8}}  # fmt: skip


def test_a_loaded_arm_is_the_checkpoint_fine_tuned_beside_a_control(first, tmp_path):
    out1, arm1 = first
    arms = [{"pruned": str(out1 / arm1["model_dir"]), "name": "again"}, {"control": True}]
    recipe = write(tmp_path / "second.yaml", second(out1, arms))
    dry = invoke(recipe, "--output", tmp_path / "dry", "--dry-run")
    assert dry.exit_code == 0 and f"arm again: loads the pruned checkpoint {out1 / arm1['model_dir']}" in dry.output
    result = invoke(recipe, "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    loaded, control = results["arms"]
    assert loaded["criterion"] == "loaded" and loaded["loaded_from"] == str((out1 / arm1["model_dir"]).resolve())
    for key in ("heads_removed", "channels_removed", "layers_removed", "removed", "removed_channels"):
        assert loaded[key] == arm1[key], key  # read from the record: what the first run's pruner removed
    assert arm1["heads_removed"] == 2 and arm1["channels_removed"] == 32
    # the same model, the same evaluation text: the first run's perplexity of it, to the last digit
    assert loaded["pruned"]["perplexity"] == arm1["pruned"]["perplexity"]
    assert loaded["pruned"]["params"] == arm1["pruned"]["params"] < control["pruned"]["params"]
    copied = sinv_prune.from_pretrained(tmp_path / "out" / "arms" / "again" / "pruned").state_dict()
    original = sinv_prune.from_pretrained(out1 / arm1["model_dir"]).state_dict()
    assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in copied)
    assert loaded["finetuned"]["perplexity"] != loaded["pruned"]["perplexity"]  # it was fine-tuned
    assert control["finetuned"] and loaded["model_dir"] == "arms/again/finetuned"


def test_bad_loaded_arms_are_one_line_usage_errors(first, tmp_path):
    out1, arm1 = first
    other = tmp_path / "other.yaml"  # a model of another shape (2 heads), pruned
    shape = {**FIRST, "model": {"architecture": "gpt2", "config": {**FIRST["model"]["config"], "n_head": 2}},
             "prune": {"arms": [{"criterion": "magnitude", "amount": 1}]}}  # fmt: skip
    assert invoke(write(other, shape), "--output", tmp_path / "o", "--quiet").exit_code == 0
    cases = [
        ([{"pruned": str(tmp_path / "nowhere")}], "prune.arms[0].pruned: ", "holds no model (no readable config.json)"),
        ([{"pruned": str(out1 / "base")}], "prune.arms[0].pruned: ", "is not a pruned model (its config has no "),
        ([{"pruned": str(tmp_path / "o" / "arms" / "magnitude-1-global" / "pruned")}], "prune.arms[0].pruned: ",
         "was not pruned from the recipe's model: num_heads 2 (the recipe's model: 4)"),
        ([{"pruned": str(out1 / arm1["model_dir"]), "criterion": "magnitude"}], "prune.arms[0]: ",
         "a 'pruned' arm loads its cut; drop criterion"),
    ]  # fmt: skip
    for arms, where, message in cases:
        result = invoke(write(tmp_path / "bad.yaml", second(out1, arms)), "--output", tmp_path / "bad")
        assert result.exit_code == 2 and result.output.startswith(f"error: {where}"), result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert not (tmp_path / "bad").exists()
