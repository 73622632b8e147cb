"""A recipe arm that searches its own cut: ``{auto: {params: ...}}`` (sinv_prune.shrink) beside a plain arm."""

from __future__ import annotations

import json

import pytest
from test_pipeline import TINY, invoke, recipe_file

from sinv_prune.pipeline.recipe import ArmSpec

AUTO = {
    **TINY,
    "name": "auto",
    "train": {"max_steps": 4, "batch_size": 8},
    "prune": {"arms": [{"auto": {"params": 0.2, "budget": 4, "batches": 8}}, {"criterion": "magnitude", "amount": 2}]},
    "finetune": {"max_steps": 1, "batch_size": 4},
}


def test_an_auto_arm_runs_end_to_end(tmp_path):
    result = invoke(recipe_file(tmp_path, AUTO), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    arm = {a["name"]: a for a in results["arms"]}["auto-p0.2"]
    base = results["baseline"]["params"]
    shrink = arm["shrink"]
    assert shrink["removed"] >= shrink["target"] > 0
    assert arm["pruned"]["params"] == base - shrink["removed"]
    assert shrink["evaluations"] <= 4 and shrink["seeds"]
    assert arm["criterion"] == "shrink"
    assert "sequential" not in shrink["heldout_ppl"]  # refine is not asked for


def test_an_auto_arm_with_refine_also_builds_the_plan_block_by_block(tmp_path):
    data = {**AUTO, "prune": {"arms": [{"auto": {"params": 0.2, "budget": 4, "batches": 8, "refine": True}}]}}
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    shrink = json.loads((tmp_path / "out" / "results.json").read_text())["arms"][0]["shrink"]
    assert "sequential" in shrink["heldout_ppl"] and shrink["built"] in ("per-layer refit", "sequential OBS refit")
    kept = "sequential" if shrink["built"] == "sequential OBS refit" else shrink["chosen"]
    ppl = shrink["heldout_ppl"]
    assert ppl[kept] == min(ppl["sequential"], ppl[shrink["chosen"]])


@pytest.mark.parametrize(
    ("arm", "message"),
    [
        ({"auto": {"params": 0.2, "to": 100}}, "exactly one of"),
        ({"auto": {"params": 0.2}, "criterion": "magnitude"}, "searches its own cut"),
    ],
)
def test_bad_auto_arms_are_refused_in_one_line(arm, message):
    with pytest.raises(ValueError, match=message):
        ArmSpec.model_validate(arm)
