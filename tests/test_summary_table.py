"""The summary table: full arm names outside a terminal, the layout column only for GQA models."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner
from test_gguf_export import EXPORT_RECIPE

from sinv_prune.cli import _print_summary, main
from sinv_prune.pipeline.report import summary_rows

LONG = "sinv_early-40pct-q_per_group-with-a-long-suffix"


def _results(gqa: bool | None) -> dict:
    base = {"params": 224_000, "perplexity": 310.5}
    arms = [
        {"name": LONG, "criterion": "sinv_early", "heads_removed": 4, "layout": "q_per_group",
         "pruned": {"params": 220_000, "perplexity": 330.25}},
        {"name": "mlp-magnitude-half", "criterion": "magnitude", "channels_removed": 96, "layout": None,
         "pruned": {"params": 200_000, "perplexity": 400.0}, "finetuned": {"params": 200_000, "perplexity": 350.0}},
    ]  # fmt: skip
    run = {} if gqa is None else {"gqa": gqa}
    return {"baseline": base, "arms": arms, "run": run}


def test_summary_prints_full_arm_names_when_not_a_terminal(capsys):
    _print_summary(_results(gqa=False), Path("runs/x"))
    out = capsys.readouterr().out
    assert LONG in out and "…" not in out
    assert "330.25" in out and "350.00" in out
    header = out.splitlines()[1]
    assert header.split()[:3] == ["arm", "criterion", "removed"]


def test_layout_column_only_for_gqa_models():
    assert "layout" not in summary_rows(_results(gqa=False))[0]
    rows = summary_rows(_results(gqa=True))
    assert [r["layout"] for r in rows] == [None, "q_per_group", None]
    assert "layout" in summary_rows(_results(gqa=None))[0]  # results from before ``gqa`` was recorded


def test_layout_column_absent_when_no_arm_removes_heads():
    results = _results(gqa=True)
    results["arms"] = results["arms"][1:]
    assert "layout" not in summary_rows(results)[0]


def test_task_means_sit_beside_perplexity_when_the_run_had_tasks(capsys):
    results = _results(gqa=False)
    assert "tasks mean pruned" not in summary_rows(results)[0]
    results["baseline"]["tasks"] = {"a": {"acc": 0.5, "acc_norm": 0.75}, "b": {"acc": 0.25}}
    results["arms"][0]["pruned"]["tasks"] = {"a": {"acc": 0.5, "acc_norm": 0.5}, "b": {"acc": 0.125}}
    results["arms"][1]["pruned"]["tasks"] = {"a": {"acc_norm": 0.25}, "b": {"acc": 0.25}}
    results["arms"][1]["finetuned"]["tasks"] = {"a": {"acc_norm": 0.5}, "b": {"acc": 0.5}}
    rows = summary_rows(results)
    assert [r["tasks mean pruned"] for r in rows] == ["0.500", "0.312", "0.250"]  # acc_norm where a task has it
    assert [r["tasks mean fine-tuned"] for r in rows] == [None, None, "0.500"]
    assert list(rows[0])[-1].startswith("forward speed-up")  # the speed column stays last
    _print_summary(results, Path("runs/x"))
    assert "tasks mean pruned" in capsys.readouterr().out


# -- GGUF sizes (export.gguf) -------------------------------------------------------------------------

GGUF_RECIPE = {
    **EXPORT_RECIPE,
    "name": "gguf-sizes",
    "prune": {"arms": EXPORT_RECIPE["prune"]["arms"][:1]},
    "export": {"gguf": {"type": "q8_0", "vocab": False, "verify": False}},
}


def test_gguf_column_holds_type_and_size_only_when_the_run_exported():
    from sinv_prune.pipeline.report import GGUF_COLUMN

    results = _results(gqa=False)
    assert GGUF_COLUMN not in summary_rows(results)[0]
    results["gguf"] = {"baseline": {"type": "f16", "size_bytes": 3 * 2**20 // 2},
                       LONG: {"type": "f16", "size_bytes": 1536}}  # fmt: skip
    rows = summary_rows(results)
    assert [r[GGUF_COLUMN] for r in rows] == ["f16, 1.5 MiB", "f16, 1.5 KiB", None]  # the last arm has no file
    assert list(rows[0])[-1].startswith("forward speed-up")


def _run_cli(recipe: dict, tmp_path: Path):
    path = tmp_path / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / recipe["name"]
    result = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return result.output, out


def test_recipe_with_export_shows_gguf_type_and_size_in_summary_report_and_card(tmp_path):
    from sinv_prune.hub.model_card import file_size
    from sinv_prune.hub.push import build_card

    output, out = _run_cli(GGUF_RECIPE, tmp_path)
    results = json.loads((out / "results.json").read_text())
    arm = results["arms"][0]
    sizes = {name: (out / results["gguf"][name]["path"]).stat().st_size for name in ("baseline", arm["name"])}
    cells = {name: f"q8_0, {file_size(size)}" for name, size in sizes.items()}
    table = output[output.index("sinv-prune:") :]
    header, _, *rows = table.splitlines()[1:5]
    assert "gguf" in header.split()
    assert cells["baseline"] in rows[0] and cells[arm["name"]] in rows[1]
    report = (out / "report.md").read_text()
    assert "| gguf |" in report and f"| {cells[arm['name']]} |" in report
    card = build_card(out / arm["model_dir"], "me/x", results=results, arm=arm["name"], stage="finetuned")
    assert "GGUF (llama.cpp) |" in card
    base_line = next(line for line in card.splitlines() if line.startswith("| base model |"))
    tuned_line = next(line for line in card.splitlines() if line.startswith("| pruned + fine-tuned"))
    pruned_line = next(line for line in card.splitlines() if line.startswith("| pruned |"))
    assert base_line.endswith(f"| {cells['baseline']} |") and tuned_line.endswith(f"| {cells[arm['name']]} |")
    assert pruned_line.endswith("| - |")  # export.gguf wrote the fine-tuned model, not the pruned one


def test_recipe_without_export_has_no_gguf_column(tmp_path):
    from sinv_prune.hub.push import build_card

    recipe = {k: v for k, v in GGUF_RECIPE.items() if k != "export"} | {"name": "no-export", "finetune": None}
    output, out = _run_cli(recipe, tmp_path)
    results = json.loads((out / "results.json").read_text())
    assert "gguf" not in output[output.index("sinv-prune:") :].splitlines()[1].split()
    assert "gguf" not in (out / "report.md").read_text().lower()
    arm = results["arms"][0]
    assert "GGUF" not in build_card(out / arm["model_dir"], "me/x", results=results, arm=arm["name"])
