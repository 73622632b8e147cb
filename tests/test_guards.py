"""Defensive code the feature tests never reach: each test breaks the guarded step and checks what is left.

Atomic writes (a write that fails half-way leaves the old file or directory and no temp file),
loads that refuse weights of the wrong shape instead of re-initialising them, and recipes that
cannot carry a Hub token. The Hub push's own guards are tested in ``test_hub.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from click.testing import CliRunner
from conftest import tiny_model

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.pipeline.recipe import RecipeError, validate_recipe
from sinv_prune.rundir import write_dir, write_text

SECRET = "hf_RecipeTokenThatMustNotBeAccepted9"


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def half_written(directory: Path, *args, **kwargs) -> None:
    """A save that writes one file, then fails as a full disk would."""
    (Path(directory) / "config.json").write_text("{}")
    raise OSError("No space left on device")


def test_write_text_that_fails_keeps_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    write_text(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text(path, "new \ud800 text\n")  # a lone surrogate cannot be encoded: fails while writing
    assert path.read_text() == "old\n"
    assert names(tmp_path) == ["state.json"]


def test_write_dir_that_fails_keeps_the_old_directory_and_no_temp_dir(tmp_path):
    path = tmp_path / "tokenizer"
    write_dir(path, lambda d: (d / "vocab.txt").write_text("old"))
    with pytest.raises(OSError, match="No space left"):
        write_dir(path, half_written)
    assert names(tmp_path) == ["tokenizer"]
    assert names(path) == ["vocab.txt"] and (path / "vocab.txt").read_text() == "old"
    with pytest.raises(OSError, match="No space left"):
        write_dir(tmp_path / "new", half_written)
    assert names(tmp_path) == ["tokenizer"]


def test_cli_prune_that_fails_while_saving_leaves_no_partial_output(tmp_path, monkeypatch):
    source = tmp_path / "src"
    tiny_model("gpt2").save_pretrained(source)
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", half_written)
    for output, extra in ((old, ["--overwrite"]), (tmp_path / "new", [])):
        result = CliRunner().invoke(main, ["prune", str(source), str(output), "--heads", "0:1", *extra])
        assert result.exit_code != 0, result.output
        assert names(tmp_path) == ["old", "src"], output  # no half-written output, no temp dir
        assert names(old) == ["keep.txt"] and (old / "keep.txt").read_text() == "mine"


def test_a_checkpoint_whose_weights_do_not_match_its_record_does_not_load(tmp_path):
    """Weights of the wrong shape raise; they are never silently re-initialised (``ignore_mismatched_sizes``)."""
    model = tiny_model("gpt2")
    sinv_prune.prune_heads(model, {0: [1, 3]})
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sinv_prune"]["pruned_heads"] = {"0": [1]}  # the record now says layer 0 keeps 3 heads; the weights 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="(?i)mismatch"):
        sinv_prune.from_pretrained(tmp_path)


def test_a_recipe_cannot_carry_a_hub_token():
    """The token comes from HF_TOKEN or ``hf auth login`` only; a recipe (often committed) that names one is refused."""
    data = {
        "model": {"path": "x/y"}, "data": {"synthetic": {}},
        "prune": {"arms": [{"criterion": "random", "amount": 1}]},
        "push": {"repo_id": "me/model", "token": SECRET},
    }  # fmt: skip
    with pytest.raises(RecipeError, match=r"^push\.token: unknown key") as info:
        validate_recipe(data)
    assert SECRET not in str(info.value)
