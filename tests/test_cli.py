"""The ``sinv-prune prune`` / ``info`` commands: results, and one-line errors with exit code 2."""

from __future__ import annotations

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
    [("0:9", "out of range"), ("0:x", "cannot parse"), ("7:0", "unknown layer"), ("0:0,1,2,3", "allow_empty_layers")],
)
def test_bad_requests_exit_2_and_leave_nothing(source, tmp_path, heads, message):
    src, _ = source
    result = run("prune", src, tmp_path / "out", "--heads", heads)
    assert result.exit_code == 2
    assert message in result.output
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
