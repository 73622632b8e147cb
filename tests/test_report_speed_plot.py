"""report.md's speed column (spread, A/A control, "below resolution") and the perplexity-vs-parameters plot."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
from conftest import tiny_model

from sinv_prune.pipeline import evaluation
from sinv_prune.pipeline.report import SPEED_COLUMN, markdown_report, perplexity_vs_params_figure, summary_rows


def measured(monkeypatch, speedup: float, noise: list[float], repeats: int = 12) -> dict:
    """A speed record as a run stores it, from scripted forward times: the arm is ``speedup`` x faster."""
    base, arm = tiny_model("gpt2"), tiny_model("gpt2")
    latency = {id(base): 1.0, id(arm): 1.0 / speedup}
    factors = itertools.cycle(noise)
    monkeypatch.setattr(evaluation, "_timed", lambda model, inputs, device: latency[id(model)] * next(factors))
    result = evaluation.compare_speed(base, arm, seq_len=8, repeats=repeats, warmup=0, control=True)
    return {**result["b"], **evaluation.speedup_fields(result)}


def results_with(arms: list[tuple[str, dict | None]], base_speed: dict | None = None) -> dict:
    def model(params, ppl, speed=None):
        return {"params": params, "perplexity": ppl, **({"speed": speed} if speed else {})}

    return {
        "baseline": model(1000, 20.0, base_speed),
        "arms": [
            {"name": name, "criterion": name.split("-")[0], "heads_removed": 2, "pruned": model(900, 21.0, speed)}
            for name, speed in arms
        ],
        "run": {"eval_split": "test", "device": "cpu"},
    }


NOISY = [1.00, 1.06, 0.95, 1.03, 0.97, 1.08, 0.93]  # +-8% per forward, as on a shared CPU
QUIET = [1.00, 1.01, 0.99, 1.02, 0.98]


def test_speed_ups_within_the_noise_are_marked_below_resolution(monkeypatch):
    small = measured(monkeypatch, 1.03, NOISY)  # a 3% effect in 8% noise
    large = measured(monkeypatch, 1.5, QUIET)
    base = measured(monkeypatch, 1.0, NOISY)
    results = results_with([("small-2", small), ("large-2", large)], base_speed=base)
    cells = {row["arm"]: row[SPEED_COLUMN] for row in summary_rows(results)}
    assert cells["small-2"] == "below resolution"
    median, (q1, q3) = large["speedup_vs_baseline"], large["speedup_iqr"]
    assert cells["large-2"] == f"{median:.2f} [{q1:.2f}, {q3:.2f}]" and 1.4 < median < 1.6
    assert cells["baseline"].startswith("A/A ")  # the baseline's own cell is its control
    report = markdown_report(results, SimpleNamespace(name="t"))
    assert f"| {SPEED_COLUMN} |" in report.splitlines()[4]  # the header names what is measured
    assert "below resolution" in report and "A/A control" in report
    assert f"median of {base['repeats']} interleaved repeats" in report and "1 thread)" in report  # conftest: 1


def test_too_few_repeats_never_resolve_and_old_results_say_so(monkeypatch):
    few = measured(monkeypatch, 1.5, QUIET, repeats=evaluation.MIN_RESOLVED_REPEATS - 1)
    old = {"speedup_vs_baseline": 1.07}  # results.json written before the A/A control existed
    cells = {row["arm"]: row[SPEED_COLUMN] for row in summary_rows(results_with([("few-2", few), ("old-2", old)]))}
    assert cells == {"baseline": None, "few-2": "below resolution", "old-2": "1.07 (spread not measured)"}


@pytest.fixture
def figure():
    figs = []

    def make(results):
        figs.append(perplexity_vs_params_figure(results))
        figs[-1].canvas.draw()
        return figs[-1].axes[0]

    yield make
    for fig in figs:
        plt.close(fig)


def test_arms_are_columns_and_one_size_is_said_once(figure):
    """Equal-size arms used to spread sideways on a parameter axis and look like different sizes."""
    results = results_with([("a-2", None), ("b-2", None), ("c-2", None)])  # identical params and perplexity
    results["arms"][0]["finetuned"] = {"params": 900, "perplexity": 20.5}
    ax = figure(results)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "a-2", "b-2", "c-2"]
    assert ax.get_title() == "every arm keeps 900 parameters (90.0% of the baseline's 1,000)"
    xs = [p[0] for coll in ax.collections for p in coll.get_offsets()]
    assert sorted(xs) == [0, 1, 1, 2, 3]  # baseline, a pruned + fine-tuned, b, c: each arm its own column
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["after pruning", "after fine-tuning"]
    assert not ax.get_lines()  # markers only, no connecting lines


def test_arms_of_different_sizes_name_their_size(figure):
    results = results_with([("a-2", None), ("b-2", None)])
    results["arms"][1]["pruned"] = {"params": 800, "perplexity": 21.0}
    ax = figure(results)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "a-2\n900 (90.0%)", "b-2\n800 (80.0%)"]
    assert ax.get_title() == ""


def test_seeds_of_one_arm_share_a_column_with_their_range(figure):
    results = results_with([("random-2-s0", None), ("random-2-s1", None), ("magnitude-2", None)])
    for i, (arm, ppl) in enumerate(zip(results["arms"], (21.0, 23.0, 22.0), strict=True)):
        arm.update(criterion=arm["name"].split("-")[0], amount=2, seed=i if i < 2 else 0)
        arm["pruned"]["perplexity"] = ppl
    ax = figure(results)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "random-2\n2 seeds", "magnitude-2"]
    means = sorted((p[0], p[1]) for coll in ax.collections for p in coll.get_offsets() if p[0] > 0)
    assert means == [(1, 22.0), (2, 22.0)]
    ((segment,),) = [c.get_segments() for c in ax.collections if hasattr(c, "get_segments") and c.get_segments()]
    assert segment[:, 1].tolist() == [21.0, 23.0]


@pytest.mark.parametrize("ppls", [(20.0, 21.4), (5.0, 400.0)])
def test_tick_labels_are_plain_numbers(figure, ppls):
    results = results_with([("a-2", None)])
    results["baseline"]["perplexity"], results["arms"][0]["pruned"]["perplexity"] = ppls
    ax = figure(results)
    labels = [t.get_text() for t in ax.get_yticklabels(which="both")]
    labels = [t for t in labels if t]
    assert labels and all(t.replace(",", "").replace(".", "").isdigit() for t in labels), labels


@pytest.mark.parametrize("resolved", [False, True])
def test_model_card_speed_sentence_follows_the_resolution(resolved):
    """The card never quotes a bare speed-up that the A/A control cannot tell from noise."""
    from sinv_prune.hub.model_card import _evaluation

    speed = {
        "speedup_vs_baseline": 1.07, "speedup_iqr": [1.05, 1.09], "speedup_range": [0.9, 1.2],
        "control": {"speedup": 1.0, "speedup_iqr": [0.98, 1.03]}, "resolved": resolved,
        "repeats": 9, "batch_size": 1, "seq_len": 64, "device": "cpu", "threads": 1,
    }  # fmt: skip
    after = {"params": 90, "perplexity": 30.0, "speed": speed}
    lines = "\n".join(
        _evaluation({"run": {}}, {"pruned": after}, "pruned", None, {"params": 100, "perplexity": 25.0}, after)
    )
    if resolved:
        assert "median [IQR]: 1.07 [1.05, 1.09]" in lines
    else:
        assert "below resolution" in lines and "1.07" not in lines
