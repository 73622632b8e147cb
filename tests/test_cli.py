"""The ``sinv-prune prune`` / ``info`` commands: results, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import model_inputs, model_output, tiny_model

import sinv_prune
from sinv_prune.cli import main, parse_heads


@pytest.fixture
def source(tmp_path):
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "src")
    return tmp_path / "src", model


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_parse_heads_accepts_compact_and_json():
    assert parse_heads("0:1,3; 5:0") == {0: [1, 3], 5: [0]}
    assert parse_heads('{"2": [0, 1]}') == {2: [0, 1]}


def test_prune_writes_a_checkpoint_that_reloads(source, tmp_path):
    src, model = source
    result = run("prune", src, tmp_path / "out", "--heads", "0:1,3;2:0")
    assert result.exit_code == 0, result.output
    assert "parameters:" in result.output
    reloaded = sinv_prune.from_pretrained(tmp_path / "out").eval()
    sinv_prune.prune_heads(model, {0: [1, 3], 2: [0]})
    torch.testing.assert_close(model_output(reloaded, model_inputs()), model_output(model, model_inputs()))

    info = run("info", tmp_path / "out")
    assert info.exit_code == 0
    assert "removed [1, 3]" in info.output


@pytest.mark.parametrize(
    ("heads", "message"),
    [("0:9", "out of range"), ("0:x", "cannot parse"), ("7:0", "unknown layer"), ("0:0,1,2,3", "--allow-empty-layers")],
)
def test_bad_requests_exit_2_and_leave_nothing(source, tmp_path, heads, message):
    src, _ = source
    result = run("prune", src, tmp_path / "out", "--heads", heads)
    assert result.exit_code == 2
    assert message in result.output
    assert "allow_empty_layers=True" not in result.output  # the CLI names its flag, not the Python keyword
    assert result.output.strip().splitlines()[-1].startswith("error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_existing_output_needs_overwrite(source, tmp_path):
    src, _ = source
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run("prune", src, tmp_path / "out", "--heads", "0:1")
    assert result.exit_code == 2
    assert "--overwrite" in result.output
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert run("prune", src, tmp_path / "out", "--heads", "0:1", "--overwrite").exit_code == 0
    assert not (tmp_path / "out" / "keep.txt").exists()


def test_missing_source_exits_2(tmp_path):
    result = run("prune", tmp_path / "nope", tmp_path / "out", "--heads", "0:1")
    assert result.exit_code == 2
    assert "no such model" in result.output


def test_group_help_shows_the_run_options():
    result = run("--help")
    assert result.exit_code == 0
    for option in ("--dry-run", "--resume", "--overwrite", "--set", "--keep-checkpoints"):
        assert option in result.output


@pytest.fixture
def run_dir(source, tmp_path):
    """A run directory as the pipeline lays it out: RUN/arms/DIR/pruned and results.json naming the arm."""
    src, _ = source
    run_root = tmp_path / "run"
    assert run("prune", src, run_root / "arms" / "taylor_2" / "pruned", "--heads", "0:1").exit_code == 0
    results = {"arms": [{"name": "taylor 2", "model_dir": "arms/taylor_2/pruned"}]}
    (run_root / "results.json").write_text(json.dumps(results))
    return run_root


@pytest.mark.parametrize("where", ["arms/taylor_2", "taylor 2", "arms/taylor_2/pruned"])
def test_info_and_prune_take_every_source_form_push_takes(run_dir, tmp_path, where):
    info = run("info", run_dir / where)
    assert info.exit_code == 0, info.output
    assert "removed [1]" in info.output
    again = run("prune", run_dir / where, tmp_path / "again", "--heads", "1:0")
    assert again.exit_code == 0, again.output
    assert "removed [1]" in run("info", tmp_path / "again").output


def test_info_of_an_unknown_arm_exits_2_naming_the_arms(run_dir):
    result = run("info", run_dir / "nope")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "taylor 2" in lines[0]


def test_help_names_every_unit_and_command():
    result = run("--help")
    assert "attention heads, MLP channels and whole layers" in result.output
    for command in ("prune", "info", "push", "align"):
        assert f"sinv-prune {command} " in result.output
    assert all(option in run("prune", "--help").output for option in ("--mlp", "--layers", "--plan"))


def summary_block(help_text: str) -> list[str]:
    """The ``sinv-prune ...`` lines of the group help's summary block (above the click option list)."""
    head = help_text.split("\nOptions:", 1)[0]
    return [line.strip() for line in head.splitlines() if line.strip().startswith("sinv-prune ")]


def test_the_help_summary_lists_every_command_with_shrink_first_of_the_model_commands():
    """A command added to the CLI is added to the summary block too; each line names a command or a recipe."""
    from sinv_prune.pipeline.recipe import builtin_recipes

    lines = summary_block(run("--help").output)
    names = [line.split()[1].strip("[]") for line in lines]
    assert set(main.commands) <= set(names), sorted(set(main.commands) - set(names))
    assert set(names) <= set(main.commands) | set(builtin_recipes()), names  # no stale command
    model_commands = [n for n in names if n in main.commands and n != "run"]
    assert model_commands[0] == "shrink", model_commands
    assert lines[names.index("run")].startswith("sinv-prune [run] RECIPE")  # `run` may be left out


def test_prune_takes_mlp_channels_and_layers(source, tmp_path):
    src, model = source
    result = run("prune", src, tmp_path / "out", "--heads", "0:1", "--mlp", "1:0-9,20", "--layers", "2")
    assert result.exit_code == 0, result.output
    reloaded = sinv_prune.from_pretrained(tmp_path / "out").eval()
    sinv_prune.prune(model, {"heads": {0: [1]}, "mlp": {1: [*range(10), 20]}, "layers": [2]})
    torch.testing.assert_close(model_output(reloaded, model_inputs()), model_output(model, model_inputs()))
    assert reloaded.config.n_layer == 2


def test_prune_takes_a_plan_file(source, tmp_path):
    src, model = source
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mlp": {"0": [3, 4]}, "layers": [1]}))
    result = run("prune", src, tmp_path / "out", "--plan", plan)
    assert result.exit_code == 0, result.output
    sinv_prune.prune(model, {"mlp": {0: [3, 4]}, "layers": [1]})
    reloaded = sinv_prune.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(model_output(reloaded, model_inputs()), model_output(model, model_inputs()))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to remove"),
        (("--layers", "x"), "--layers: cannot parse"),
        (("--mlp", "0-3"), "--mlp: cannot parse"),
        (("--layers", "0,1,2"), "at least one must stay"),
        (("--plan", "PLAN", "--heads", "0:1"), "do not combine"),
        (("--plan", "PLAN"), "unknown keys ['head']"),
        (("--plan", "MISSING"), "--plan: cannot read"),
    ],
)
def test_bad_plans_exit_2_and_leave_nothing(source, tmp_path, args, message):
    src, _ = source
    (tmp_path / "plan.json").write_text(json.dumps({"head": {"0": [1]}}))
    args = [{"PLAN": tmp_path / "plan.json", "MISSING": tmp_path / "none.json"}.get(a, a) for a in args]
    result = run("prune", src, tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.strip().splitlines()[-1].startswith("error:")
    assert not (tmp_path / "out").exists()


def test_a_diverged_training_stops_the_run_with_one_line(tmp_path, monkeypatch):
    from sinv_prune.pipeline import stages

    def diverge(*args, **kwargs):
        raise FloatingPointError("ECD: the loss was NaN or infinite in 11 of 40 steps\n(more than 10)")

    monkeypatch.setattr(stages, "run_recipe", diverge)
    result = run("quickstart", "--output", tmp_path / "run", "--quiet")
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: ECD: the loss was NaN or infinite in 11 of 40 steps (more than 10)"
    )
