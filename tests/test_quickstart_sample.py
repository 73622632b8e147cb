"""docs/quickstart/ is what today's code writes: report.md regenerates from results.json, byte for byte,
and the captured console of that run is short (under 60 lines and 8 KB)."""

from __future__ import annotations

import json
from pathlib import Path

from sinv_prune.pipeline.recipe import load_recipe, recipe_to_yaml
from sinv_prune.pipeline.report import markdown_report, summary_rows

SAMPLE = Path(__file__).resolve().parents[1] / "docs" / "quickstart"


def test_sample_report_is_what_the_report_stage_writes():
    results = json.loads((SAMPLE / "results.json").read_text())
    recipe = load_recipe(SAMPLE / "recipe.yaml")
    written = (SAMPLE / "report.md").read_text()
    header = next(line for line in written.splitlines() if line.startswith("| arm "))
    assert [c.strip() for c in header.strip("|").split("|")] == list(summary_rows(results)[0])
    assert written == markdown_report(results, recipe)


def test_sample_recipe_is_the_shipped_quickstart():
    assert recipe_to_yaml(load_recipe(SAMPLE / "recipe.yaml")) == recipe_to_yaml(load_recipe("quickstart"))


def test_sample_console_is_short():
    console = (SAMPLE / "console.txt").read_text()
    assert len(console.splitlines()) < 60 and len(console.encode()) < 8 * 1024
    assert "report: " in console and "\r" not in console
    for plot in json.loads((SAMPLE / "results.json").read_text())["plots"]:
        assert (SAMPLE / plot).is_file()
