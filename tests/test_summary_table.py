"""The summary table: full arm names outside a terminal, the layout column only for GQA models."""

from __future__ import annotations

from pathlib import Path

from sinv_prune.cli import _print_summary
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
