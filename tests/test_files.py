"""Files the project writes: the user's umask (not mkstemp's 0600) and strict JSON."""

from __future__ import annotations

import ast
import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.rundir import write_dir, write_json, write_text
from sinv_prune.strict_json import with_null_reasons


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_take_the_umask(tmp_path, umask_022):
    write_text(tmp_path / "a.txt", "x")
    write_json(tmp_path / "b.json", {"a": 1})
    write_dir(tmp_path / "model", lambda d: tiny_model("gpt2").save_pretrained(d))
    assert _mode(tmp_path / "a.txt") == 0o644
    assert _mode(tmp_path / "b.json") == 0o644
    assert _mode(tmp_path / "model") == 0o755
    files = list((tmp_path / "model").iterdir())
    assert any(f.name == "model.safetensors" for f in files)
    assert {f.name: _mode(f) for f in files} == {f.name: 0o644 for f in files}


def test_prune_command_output_takes_the_umask(tmp_path, umask_022):
    tiny_model("gpt2").save_pretrained(tmp_path / "src")
    os.umask(0o027)
    result = CliRunner().invoke(main, ["prune", str(tmp_path / "src"), str(tmp_path / "out"), "--heads", "0:1"])
    assert result.exit_code == 0, result.output
    assert _mode(tmp_path / "out") == 0o750
    assert _mode(tmp_path / "out" / "model.safetensors") == 0o640


def test_json_is_strict(tmp_path):
    with pytest.raises(ValueError):
        write_json(tmp_path / "bad.json", {"x": float("inf")})
    assert not (tmp_path / "bad.json").exists()
    assert not list(tmp_path.iterdir())  # no temp file left behind
    write_json(tmp_path / "ok.json", {"x": None})
    assert json.loads((tmp_path / "ok.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == {"x": None}


def test_sinv_depth_infinite_ratio_is_null_with_a_reason(tmp_path):
    from sinv_prune import get_criterion

    model = tiny_model("llama", num_key_value_heads=6)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.q_proj.weight.copy_(-attn.k_proj.weight)  # C_Q = 0 in layer 1: r = C_FF / 0
    criterion = get_criterion("sinv_depth", unit="layers")
    scores = criterion.compute(model)
    assert scores[1] == -math.inf  # still removed first
    report = criterion.report()
    assert report["ratio"][1] is None and report["ratio"][0] is not None
    assert "layers [1]" in report["ratio_null"]
    write_json(tmp_path / "score.json", with_null_reasons({"sinv_depth": {"scores": scores, "report": report}}))
    data = json.loads((tmp_path / "score.json").read_text(), parse_constant=pytest.fail)
    assert data["sinv_depth"]["scores"][1] is None
    assert data["non_finite"] == {"sinv_depth.scores.1": "was -inf"}


def test_report_writes_strict_results_json(tmp_path):
    from sinv_prune.pipeline.recipe import load_recipe
    from sinv_prune.pipeline.report import write_report

    base = {"params": 100, "perplexity": 10.0}
    arm = {"name": "a", "criterion": "random", "heads_removed": 2, "pruned": {"params": 90, "perplexity": math.inf}}
    recipe = load_recipe(Path(sinv_prune.__file__).parents[1] / "recipes" / "quickstart.yaml")
    write_report(tmp_path, {"baseline": base, "arms": [arm]}, recipe, plots=False)
    data = json.loads((tmp_path / "results.json").read_text(), parse_constant=pytest.fail)
    assert data["arms"][0]["pruned"]["perplexity"] is None
    assert data["non_finite"] == {"arms.0.pruned.perplexity": "was inf"}


def test_every_json_writer_in_the_package_is_strict():
    """No ``json.dump``/``json.dumps`` call in sinv_prune outside strict_json: they all go through it."""
    root = Path(sinv_prune.__file__).parent
    loose = []
    for path in root.rglob("*.py"):
        if path.name == "strict_json.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("dump", "dumps")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "json"
            ) and not any(k.arg == "allow_nan" for k in node.keywords):
                loose.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not loose, f"json.dump(s) without allow_nan=False (use sinv_prune.strict_json): {loose}"
