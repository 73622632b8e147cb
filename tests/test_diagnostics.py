"""Diagnostics from a trace: time to threshold, plateau, layer verdicts, PNG plots."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from sinv_prune.scoring.diagnostics import (
    find_plateau,
    layer_summary,
    loss_series,
    plot_curves,
    plot_heatmaps,
    plot_trace,
    summarize_trace,
    time_to_threshold,
)
from sinv_prune.scoring.trace import append_trace

# Layer 0 converges (head 0 at step 20, head 1 at step 30), layer 1 head 0 dips below at step 30
# and comes back up, layer 1 head 1 and layer 2 never do. The loss falls, then flattens from step 30.
C_Q = {
    0: [[0.70, 0.72], [0.70, 0.71], [0.50, 0.72], [0.40, 0.71]],
    10: [[0.30, 0.50], [0.40, 0.70], [0.60, 0.70], [0.45, 0.70]],
    20: [[0.04, 0.20], [0.10, 0.69], [0.55, 0.69], [0.45, 0.69]],
    30: [[0.02, 0.03], [0.04, 0.69], [0.55, 0.69], [0.45, 0.69]],
    40: [[0.01, 0.02], [0.06, 0.69], [0.55, 0.69], [0.45, 0.69]],
    50: [[0.01, 0.01], [0.06, 0.68], [0.55, 0.69], [0.45, 0.69]],
}
LOSS = {0: 6.0, 10: 4.0, 20: 3.2, 30: 3.0, 40: 2.99, 50: 2.985}


def _write_trace(path, with_loss=True):
    append_trace(path, {"event": "train_begin", "step": 0, "threshold": 0.05, "measures": ["C_Q", "C_V", "C_FF"]})
    for step, c_q in C_Q.items():
        layers = len(c_q)
        record = {
            "step": step,
            "epoch": step / 25,
            "C_Q": c_q,
            "C_V": [[0.01, 0.01]] * layers,  # every other measure converged: C_Q decides
            "C_FF": [0.01] * layers,
            "C_V_layer": [None] * layers,
        }
        if with_loss:
            record.update(loss=LOSS[step], loss_step=step)
        append_trace(path, record)
    append_trace(path, {"event": "stop_rule_not_fired", "step": 50, "min_max_measure": 0.69})
    return path


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert data[-8:-4] == b"IEND"
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (height, width)


def test_time_to_threshold(tmp_path):
    ttt = time_to_threshold(_write_trace(tmp_path / "t.jsonl"))
    assert ttt["threshold"] == 0.05
    assert ttt["step"] == [[20, 30], [30, None], [None, None], [None, None]]
    assert ttt["epoch"][0] == [0.8, 1.2]
    assert ttt["converged_at_end"] == [[True, True], [False, False], [False, False], [False, False]]
    assert time_to_threshold(tmp_path / "t.jsonl", threshold=0.5)["step"][2] == [None, None]
    assert time_to_threshold(tmp_path / "t.jsonl", threshold=0.5)["step"][3] == [0, None]


def test_resumed_trace_keeps_the_latest_line_per_step(tmp_path):
    path = _write_trace(tmp_path / "t.jsonl")
    # a resumed run restarts from step 30 and measures 40 and 50 again, now with layer 1 head 1 converging
    for step in (40, 50):
        c_q = [list(layer) for layer in C_Q[step]]
        c_q[1][1] = 0.01
        append_trace(path, {"step": step, "C_Q": c_q, "C_V": [[0.01] * 2] * 4, "C_FF": [0.01] * 4})
    ttt = time_to_threshold(path)
    assert ttt["step"][1] == [30, 40]
    assert summarize_trace(path)["measurements"] == 6


def test_plateau_definition():
    steps = [0, 10, 20, 30, 40, 50]
    p = find_plateau(steps, [LOSS[s] for s in steps], smooth=1)
    # from step 30 on the loss never gets more than 1% below its value there (2.985 > 3.0 * 0.99)
    assert p["plateaued"] and p["start_step"] == 30 and p["fraction"] == pytest.approx(0.4)
    falling = find_plateau(steps, [6, 5, 4, 3, 2, 1], smooth=1)
    assert not falling["plateaued"] and falling["start_step"] == 50
    assert not find_plateau(steps[:2], [6, 5])["plateaued"]  # too few points to judge
    # a late dip of a noisy curve moves the start; a centred mean of 3 points absorbs it
    noisy = [6, 4, 3.0, 3.05, 2.9, 3.02]
    assert find_plateau(steps, noisy)["start_step"] == 40
    assert find_plateau(steps, noisy, smooth=3)["start_step"] == 30
    # short flat tail below min_fraction: not a plateau yet
    assert not find_plateau(steps, [6, 5, 4, 3, 2, 1.995], smooth=1, min_fraction=0.25)["plateaued"]


def test_loss_series_dedups_and_prefers_eval(tmp_path):
    path = tmp_path / "t.jsonl"
    for step, loss_step in ((2, 0), (4, 4), (6, 4), (8, 8)):
        append_trace(path, {"step": step, "C_Q": [[0.5]], "loss": float(loss_step), "loss_step": loss_step})
    assert loss_series(path) == ("loss", [0, 4, 8], [0.0, 4.0, 8.0])
    for step in (10, 12, 14):
        append_trace(path, {"step": step, "C_Q": [[0.5]], "eval_loss": 1.0 / step, "eval_loss_step": step})
    assert loss_series(path)[0:2] == ("eval_loss", [10, 12, 14])


def test_layer_summary_and_summarize_trace(tmp_path):
    path = _write_trace(tmp_path / "t.jsonl")
    layers = layer_summary(path)
    assert [e["status"] for e in layers] == ["converged", "undertrained", "undertrained", "undertrained"]
    assert layers[0]["converged_step"] == 30 and layers[1]["converged_step"] is None
    assert layers[1]["heads_below_at_end"] == 0 and layers[0]["heads_below_at_end"] == 2
    assert layers[2]["C_Q_mean_change_during_plateau"] == pytest.approx(0.0)
    summary = summarize_trace(path)
    json.dumps(summary, allow_nan=False)  # strictly JSON-serialisable
    assert summary["undertrained_layers"] == [1, 2, 3]
    assert summary["never_converged_layers"] == [1, 2, 3]
    assert summary["stop_rule"]["fired"] is False and summary["stop_rule"]["min_max_measure"] == 0.69
    assert summary["loss"]["key"] == "loss" and summary["loss"]["start_step"] == 30
    assert summary["heads_total"] == 8 and summary["heads_ever_below"] == 3 and summary["heads_below_at_end"] == 2
    assert summary["measurements"] == 6 and (summary["first_step"], summary["last_step"]) == (0, 50)
    # without a loss the verdict on layers that have not converged stays open
    nolo = summarize_trace(_write_trace(tmp_path / "n.jsonl", with_loss=False))
    assert nolo["undertrained_layers"] == [] and nolo["layers"][1]["status"] == "not_converged"
    assert nolo["loss"]["key"] is None


def test_plots_are_valid_pngs(tmp_path):
    path = _write_trace(tmp_path / "t.jsonl")
    files = plot_trace(path, tmp_path / "plots")
    assert set(files) == {"heatmaps", "curves"}
    for f in files.values():
        _assert_png(f)
    _assert_png(plot_heatmaps(path, tmp_path / "one.png", n_times=1))
    _assert_png(plot_curves(_write_trace(tmp_path / "n.jsonl", with_loss=False), tmp_path / "noloss.png"))


def test_diagnostics_on_a_real_callback_trace(tmp_path):
    """The callback's own trace (GQA model, uneven head counts after pruning) goes through every function."""
    from conftest import tiny_model

    from sinv_prune import prune_heads
    from sinv_prune.pipeline.tracking import track

    model = tiny_model("llama")
    prune_heads(model, {1: [0, 1, 2]})
    path = tmp_path / "t.jsonl"
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        track(model, path, step * 5, loss=3.0 - step)
    summary = summarize_trace(path)
    assert [len(h) for h in summary["time_to_threshold"]["step"]] == [6, 3, 6]
    for f in plot_trace(path, tmp_path / "plots").values():
        _assert_png(f)


def _far_trace(path):
    """C_Q 0.65-0.85 throughout, as real models: no head near the 0.05 threshold."""
    append_trace(path, {"event": "train_begin", "step": 0, "threshold": 0.05, "measures": ["C_Q"]})
    for step in (0, 10, 20):
        append_trace(path, {"step": step, "C_Q": [[0.65 + 0.01 * step / 10, 0.85], [0.7, 0.8]]})


def test_heatmap_scale_spans_the_values_not_the_threshold(tmp_path):
    from sinv_prune.scoring.diagnostics import heatmaps_figure

    _far_trace(tmp_path / "t.jsonl")
    fig = heatmaps_figure(tmp_path / "t.jsonl", n_times=3)
    image = fig.axes[0].get_images()[0]
    assert image.get_clim() == pytest.approx((0.65, 0.85))
    last = fig.axes[3]  # after the three heatmaps: the time-to-threshold panel
    assert not last.get_images() and not last.axison
    assert "no head crossed" in " ".join(t.get_text() for t in last.texts)
    assert "0.05" in " ".join(t.get_text() for t in last.texts)


def test_time_to_threshold_panel_is_drawn_when_a_head_crossed(tmp_path):
    from sinv_prune.scoring.diagnostics import heatmaps_figure

    path = tmp_path / "t.jsonl"
    _far_trace(path)
    append_trace(path, {"step": 30, "C_Q": [[0.02, 0.85], [0.7, 0.8]]})
    fig = heatmaps_figure(path, n_times=2)
    panel = fig.axes[2]
    assert panel.get_images() and not panel.texts
