"""Diagnostics from a convergence trace: per-layer verdicts, per-head time to threshold, plots.

The NN6 paper reads a trace three ways: layers whose measures stay high while the loss
has plateaued are *undertrained*; heads whose ``C_Q`` drops below the threshold early
are redundant; and the stopping rule says when training is done. This module turns a
trace written by :mod:`sinv_prune.pipeline.tracking` (or any trace in the format of
:mod:`sinv_prune.scoring.trace`) into those answers.

Definitions used throughout:

* measurement lines are taken one per step in step order (a resumed run that measured a step
  again overrides the earlier line);
* **time to threshold** of a head: the step (and epoch) of the first measurement where its
  ``C_Q`` is below the threshold, ``None`` if it never is;
* a **layer converged** at a measurement when every value of the rule's measures in that
  layer (``C_Q`` and ``C_V`` of each head, the layer's ``C_FF``; ``None`` ignored) is below
  the threshold -- the paper's rule restricted to one layer;
* the **loss plateau** (see :func:`find_plateau`): the loss series is ``eval_loss`` when the
  trace holds at least 3 distinct values of it, else ``loss`` (train; the Trainer already
  averages it over ``logging_steps``); optionally smoothed by a centred mean of ``smooth``
  points (default 1: none); the plateau starts at the earliest point after which
  the smoothed loss never goes more than ``rel_tol`` (default 1%) below its value there; the
  loss *has plateaued* when that plateau spans at least ``min_fraction`` (default 20%) of the
  steps the loss series covers;
* a layer is **undertrained** when it has not converged at the last measurement while the
  loss has plateaued; **not_converged** when it has not converged and the loss is still
  falling (no verdict yet); **converged** otherwise.

Plots are written with matplotlib's object API on the Agg canvas (no pyplot, no global
backend change); matplotlib is imported only by the plotting functions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from sinv_prune import strict_json
from sinv_prune.scoring.trace import measurements as _measurement_lines
from sinv_prune.scoring.trace import read_trace

DEFAULT_THRESHOLD = 0.05
DEFAULT_RULE_MEASURES = ("C_Q", "C_V", "C_FF")

Trace = list[dict]


def _load(trace: str | os.PathLike | Trace) -> Trace:
    return read_trace(trace) if isinstance(trace, (str, os.PathLike)) else list(trace)


def measurements(trace: Trace) -> list[dict]:
    """The measurement lines, one per step, in step order: where a resumed run measured a step
    again (it restarted from an earlier checkpoint), the later line wins."""
    by_step: dict = {}
    for i, r in enumerate(_measurement_lines(trace)):
        by_step[r.get("step", i)] = r
    return [by_step[k] for k in sorted(by_step)]


def _settings(trace: Trace) -> dict:
    """The settings note written by the callback at train begin (the last one), or ``{}``."""
    notes = [r for r in trace if r.get("event") == "train_begin"]
    return notes[-1] if notes else {}


def _threshold(trace: Trace, threshold: float | None) -> float:
    return float(threshold if threshold is not None else _settings(trace).get("threshold", DEFAULT_THRESHOLD))


def _clean(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _nums(values) -> list[float]:
    if values is None:
        return []
    if isinstance(values, (int, float)):
        return [float(values)]
    return [v for item in values for v in _nums(item)]


# -- time to threshold --------------------------------------------------------------------------


def time_to_threshold(trace: str | os.PathLike | Trace, threshold: float | None = None, measure: str = "C_Q") -> dict:
    """Per head, the first measurement where ``measure`` is below ``threshold``.

    Returns ``{"measure", "threshold", "step": [[int | None per head] per layer],
    "epoch": [[float | None]], "converged_at_end": [[bool]]}``. Head ``h`` of layer ``l`` is
    indexed as in each measurement line (head counts must not change along the trace).
    """
    trace = _load(trace)
    threshold = _threshold(trace, threshold)
    records = [r for r in measurements(trace) if measure in r]
    if not records:
        return {"measure": measure, "threshold": threshold, "step": [], "epoch": [], "converged_at_end": []}
    shape = [len(layer) for layer in records[0][measure]]
    steps = [[None] * n for n in shape]
    epochs = [[None] * n for n in shape]
    for r in records:
        values = r[measure]
        if [len(layer) for layer in values] != shape:
            raise ValueError(
                f"head counts change along the trace at step {r.get('step')}: {shape} -> "
                f"{[len(layer) for layer in values]}"
            )
        for li, layer in enumerate(values):
            for h, v in enumerate(layer):
                if steps[li][h] is None and v is not None and v < threshold:
                    steps[li][h], epochs[li][h] = r.get("step"), r.get("epoch")
    final = records[-1][measure]
    at_end = [[v is not None and v < threshold for v in layer] for layer in final]
    return {"measure": measure, "threshold": threshold, "step": steps, "epoch": epochs, "converged_at_end": at_end}


# -- loss plateau -------------------------------------------------------------------------------


def loss_series(trace: str | os.PathLike | Trace) -> tuple[str | None, list[int], list[float]]:
    """``(key, steps, values)`` of the loss recorded in the measurement lines, one point per
    logged value (deduplicated by the step it was logged at): ``eval_loss`` when there are at
    least 3 distinct points of it, else ``loss``; ``(None, [], [])`` when the trace has none."""
    records = measurements(_load(trace))
    series = {}
    for key in ("eval_loss", "loss"):
        points: dict[int, float] = {}
        for r in records:
            if r.get(key) is not None:
                points[int(r.get(f"{key}_step") if r.get(f"{key}_step") is not None else r["step"])] = float(r[key])
        series[key] = sorted(points.items())
    key = "eval_loss" if len(series["eval_loss"]) >= 3 else ("loss" if series["loss"] else None)
    if key is None:
        return None, [], []
    return key, [s for s, _ in series[key]], [v for _, v in series[key]]


def find_plateau(
    steps: Sequence[int], values: Sequence[float], *, rel_tol: float = 0.01, min_fraction: float = 0.2, smooth: int = 1
) -> dict:
    """Where a loss curve stops improving (definition in the module docstring).

    Returns ``{"plateaued": bool, "start_step": int | None, "fraction": float | None,
    "rel_tol", "min_fraction", "smooth", "points": int}``; ``fraction`` is the share of the
    covered steps that lies in the plateau.
    """
    out = {
        "plateaued": False,
        "start_step": None,
        "fraction": None,
        "rel_tol": rel_tol,
        "min_fraction": min_fraction,
        "smooth": smooth,
        "points": len(values),
    }
    if len(values) < 3 or steps[-1] == steps[0]:
        return out
    half = max(0, int(smooth) - 1) // 2  # centred window: no lag at the knee
    sm = [
        sum(values[max(0, i - half) : i + half + 1]) / len(values[max(0, i - half) : i + half + 1])
        for i in range(len(values))
    ]
    start, later_min = len(sm) - 1, sm[-1]
    for i in range(len(sm) - 1, -1, -1):
        later_min = min(later_min, sm[i])
        if later_min >= sm[i] - rel_tol * abs(sm[i]):
            start = i
    fraction = (steps[-1] - steps[start]) / (steps[-1] - steps[0])
    out.update(
        start_step=int(steps[start]),
        fraction=round(fraction, 4),
        plateaued=bool(fraction >= min_fraction and start < len(sm) - 1),
    )
    return out


# -- per layer ----------------------------------------------------------------------------------


def _layer_values(record: dict, layer: int, measures: Sequence[str]) -> list[float]:
    out = []
    for m in measures:
        if m in record and layer < len(record[m]):
            out.extend(_nums(record[m][layer]))
    return out


def _stats(values: list[float]) -> dict:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def layer_summary(
    trace: str | os.PathLike | Trace,
    threshold: float | None = None,
    measures: Sequence[str] | None = None,
    plateau: dict | None = None,
) -> list[dict]:
    """One dict per layer: ``C_Q`` statistics first / final, the final max of each rule measure,
    ``converged_step`` (first measurement where the layer converged), ``converged_at_end``,
    ``heads_below_at_end``, the mean ``C_Q`` change during the loss plateau and ``status``
    (``"converged"``, ``"undertrained"`` or ``"not_converged"``; definitions in the module docstring)."""
    trace = _load(trace)
    threshold = _threshold(trace, threshold)
    measures = tuple(measures or _settings(trace).get("measures") or DEFAULT_RULE_MEASURES)
    records = measurements(trace)
    if not records:
        return []
    if plateau is None:
        _, steps, values = loss_series(trace)
        plateau = find_plateau(steps, values)
    first, last = records[0], records[-1]
    out = []
    for layer in range(len(last["C_Q"])):
        converged_step = next(
            (r.get("step") for r in records if (vals := _layer_values(r, layer, measures)) and max(vals) < threshold),
            None,
        )
        final_vals = _layer_values(last, layer, measures)
        at_end = bool(final_vals) and max(final_vals) < threshold
        entry = {
            "layer": layer,
            "num_heads": len(last["C_Q"][layer]),
            "C_Q_first": _stats(_nums(first["C_Q"][layer])),
            "C_Q_final": _stats(_nums(last["C_Q"][layer])),
            "final_max": {m: _clean(max(_nums(last[m][layer]), default=None)) for m in measures if m in last},
            "converged_step": converged_step,
            "converged_at_end": at_end,
            "heads_below_at_end": sum(1 for v in last["C_Q"][layer] if v is not None and v < threshold),
            "C_Q_mean_change_during_plateau": None,
        }
        if plateau.get("plateaued"):
            inside = [r for r in records if r.get("step", 0) >= plateau["start_step"]]
            if len(inside) >= 2:
                a, b = _stats(_nums(inside[0]["C_Q"][layer]))["mean"], _stats(_nums(inside[-1]["C_Q"][layer]))["mean"]
                if a is not None and b is not None:
                    entry["C_Q_mean_change_during_plateau"] = b - a
        if at_end:
            entry["status"] = "converged"
        else:
            entry["status"] = "undertrained" if plateau.get("plateaued") else "not_converged"
        out.append(entry)
    return out


def summarize_trace(
    path: str | os.PathLike | Trace,
    threshold: float | None = None,
    measures: Sequence[str] | None = None,
    **plateau_opts,
) -> dict:
    """Everything the trace says, as a JSON-serialisable dict.

    Keys: ``threshold``, ``measures``, ``measurements`` (count), ``first_step`` / ``last_step``,
    ``stop_rule`` (``{"fired": bool, ...the fired / not-fired note}``), ``loss`` (the series key
    and :func:`find_plateau`), ``layers`` (:func:`layer_summary`), ``undertrained_layers``,
    ``never_converged_layers`` (layers that converged at no measurement), ``time_to_threshold``
    (:func:`time_to_threshold` on ``C_Q``), ``heads_total``, ``heads_ever_below`` and
    ``heads_below_at_end``. ``plateau_opts`` go to :func:`find_plateau`.
    """
    trace = _load(path)
    threshold = _threshold(trace, threshold)
    measures = tuple(measures or _settings(trace).get("measures") or DEFAULT_RULE_MEASURES)
    records = measurements(trace)
    key, steps, values = loss_series(trace)
    plateau = find_plateau(steps, values, **plateau_opts)
    layers = layer_summary(trace, threshold, measures, plateau)
    ttt = time_to_threshold(trace, threshold)
    fired = [r for r in trace if r.get("event") == "stop_rule_fired"]
    not_fired = [r for r in trace if r.get("event") == "stop_rule_not_fired"]
    if fired:
        stop = {"fired": True, **{k: v for k, v in fired[-1].items() if k != "event"}}
    elif not_fired:
        stop = {"fired": False, **{k: v for k, v in not_fired[-1].items() if k != "event"}}
    else:
        stop = {"fired": None}  # no note: the trace did not come from the callback, or the run is still going
    summary = {
        "trace": str(path) if isinstance(path, (str, os.PathLike)) else None,
        "threshold": threshold,
        "measures": list(measures),
        "measurements": len(records),
        "first_step": records[0].get("step") if records else None,
        "last_step": records[-1].get("step") if records else None,
        "stop_rule": stop,
        "loss": {"key": key, "first": values[0] if values else None, "last": values[-1] if values else None, **plateau},
        "layers": layers,
        "undertrained_layers": [e["layer"] for e in layers if e["status"] == "undertrained"],
        "never_converged_layers": [e["layer"] for e in layers if e["converged_step"] is None],
        "time_to_threshold": ttt,
        "heads_total": sum(len(layer) for layer in ttt["step"]),
        "heads_ever_below": sum(s is not None for layer in ttt["step"] for s in layer),
        "heads_below_at_end": sum(bool(b) for layer in ttt["converged_at_end"] for b in layer),
    }
    return _jsonable(summary)


def _jsonable(x):
    """``x`` with NaN / inf floats as ``None`` and numpy / torch scalars as Python numbers."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# -- plots --------------------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _grid(values: list[list[float | None]]):
    """Layers x max-heads float array, NaN where a layer has fewer heads or a value is None."""
    import numpy as np

    width = max((len(layer) for layer in values), default=0)
    grid = np.full((len(values), max(width, 1)), np.nan)
    for li, layer in enumerate(values):
        for h, v in enumerate(layer):
            if v is not None:
                grid[li, h] = v
    return grid


def plot_heatmaps(
    trace: str | os.PathLike | Trace,
    out_path: str | os.PathLike,
    *,
    measure: str = "C_Q",
    n_times: int = 4,
    threshold: float | None = None,
) -> Path:
    """A row of layer x head heatmaps of ``measure`` at ``n_times`` evenly spaced measurements
    (first and last included, one shared colour scale), then a heatmap of each head's time to
    threshold (grey: never). Writes a PNG to ``out_path`` and returns its path."""
    fig = heatmaps_figure(trace, measure=measure, n_times=n_times, threshold=threshold)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def heatmaps_figure(
    trace: str | os.PathLike | Trace, *, measure: str = "C_Q", n_times: int = 4, threshold: float | None = None
):
    """The figure :func:`plot_heatmaps` saves.

    The colour scale spans the values shown (not down to the threshold, which real models stay far
    from: C_Q 0.65-0.85 against 0.05 left no contrast); the time-to-threshold panel says "no head
    crossed" instead of drawing an all-grey grid when no head ever went below the threshold.
    """
    import numpy as np

    trace = _load(trace)
    threshold = _threshold(trace, threshold)
    records = [r for r in measurements(trace) if measure in r]
    if not records:
        raise ValueError(f"the trace holds no {measure} measurements")
    n = min(max(1, n_times), len(records))
    picks = sorted({round(i * (len(records) - 1) / max(1, n - 1)) for i in range(n)})
    grids = [_grid(records[i][measure]) for i in picks]
    finite = np.concatenate([g[np.isfinite(g)] for g in grids])
    vmin = float(finite.min()) if finite.size else 0.0
    vmax = float(finite.max()) if finite.size else 1.0
    if vmax <= vmin:  # one value everywhere: a visible, centred scale
        vmin, vmax = vmin - 0.01, vmax + 0.01
    layers, heads = grids[0].shape
    panel_w = max(1.8, 0.28 * heads + 0.9)
    panel_h = max(2.2, 0.16 * layers + 1.2)
    fig = _figure(panel_w * (len(picks) + 1) + 1.2, panel_h)
    axes = fig.subplots(1, len(picks) + 1, squeeze=False)[0]
    cmap = _cmap("viridis")
    image = None
    for ax, i, grid in zip(axes, picks, grids, strict=False):
        image = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        r = records[i]
        epoch = f", ep {r['epoch']:.2f}" if isinstance(r.get("epoch"), (int, float)) else ""
        ax.set_title(f"{measure} step {r.get('step')}{epoch}", fontsize=8)
        _label(ax, layers, heads)
    fig.colorbar(image, ax=axes[: len(picks)].tolist(), shrink=0.9, label=f"{measure} (threshold {threshold:g})")
    ttt = time_to_threshold(trace, threshold, measure)
    steps = _grid(ttt["step"])
    ax = axes[-1]
    if np.isfinite(steps).any():
        never = _cmap("viridis").with_extremes(bad="0.8")  # dark: early, as dark is low C_Q
        shown = ax.imshow(np.ma.masked_invalid(steps), aspect="auto", cmap=never, interpolation="nearest")
        ax.set_title(f"step {measure} < {threshold:g} (grey: never)", fontsize=8)
        _label(ax, layers, heads)
        fig.colorbar(shown, ax=ax, shrink=0.9, label="step")
    else:
        ax.set_axis_off()
        lowest = f"\n(lowest {measure} seen: {vmin:.2f})" if finite.size else ""
        ax.text(0.5, 0.5, f"no head crossed\n{measure} < {threshold:g}{lowest}", ha="center", va="center",
                fontsize=9, transform=ax.transAxes)  # fmt: skip
    return fig


def plot_curves(
    trace: str | os.PathLike | Trace,
    out_path: str | os.PathLike,
    *,
    measure: str = "C_Q",
    threshold: float | None = None,
) -> Path:
    """``measure`` over training per layer: the layer mean as a line, min-max over its heads as a
    band, the threshold dashed; below it the loss with the plateau shaded when the trace has a
    loss. Writes a PNG to ``out_path`` and returns its path."""
    import numpy as np

    trace = _load(trace)
    threshold = _threshold(trace, threshold)
    records = [r for r in measurements(trace) if measure in r]
    if not records:
        raise ValueError(f"the trace holds no {measure} measurements")
    key, loss_steps, loss_values = loss_series(trace)
    x = np.array([r.get("step", i) for i, r in enumerate(records)], dtype=float)
    layers = len(records[-1][measure])
    fig = _figure(8, 6.5 if key else 4.5)
    if key:
        ax, lax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.3])
    else:
        ax, lax = fig.subplots(1, 1), None
    cmap = _cmap("viridis")
    for layer in range(layers):
        stats = [_stats(_nums(r[measure][layer]) if layer < len(r[measure]) else []) for r in records]
        mean = np.array([s["mean"] if s["mean"] is not None else np.nan for s in stats])
        low = np.array([s["min"] if s["min"] is not None else np.nan for s in stats])
        high = np.array([s["max"] if s["max"] is not None else np.nan for s in stats])
        color = cmap(layer / max(1, layers - 1))
        ax.fill_between(x, low, high, color=color, alpha=0.12, linewidth=0)
        ax.plot(x, mean, color=color, linewidth=1.2, label=f"layer {layer}" if layers <= 8 else None)
    ax.axhline(threshold, color="crimson", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    ax.set_ylabel(f"{measure} (layer mean, band: min-max over heads)")
    ax.set_title(f"{measure} per layer over training")
    ax.legend(fontsize=7, loc="best")
    if layers > 8:  # too many for a legend: the colour encodes depth
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        fig.colorbar(ScalarMappable(Normalize(0, layers - 1), cmap), ax=ax, label="layer", pad=0.01)
    ax.grid(alpha=0.3)
    if lax is not None:
        lax.plot(loss_steps, loss_values, color="black", marker=".", linewidth=1)
        plateau = find_plateau(loss_steps, loss_values)
        if plateau["plateaued"]:
            lax.axvspan(plateau["start_step"], loss_steps[-1], color="orange", alpha=0.2, label="plateau")
            lax.legend(fontsize=7)
        lax.set_ylabel(key)
        lax.grid(alpha=0.3)
        lax.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def plot_trace(
    trace: str | os.PathLike | Trace, out_dir: str | os.PathLike, *, n_times: int = 4, threshold: float | None = None
) -> dict[str, Path]:
    """Both plots of a trace into ``out_dir``: ``{"heatmaps": ..., "curves": ...}`` PNG paths."""
    trace = _load(trace)
    out_dir = Path(out_dir)
    return {
        "heatmaps": plot_heatmaps(trace, out_dir / "C_Q_heatmaps.png", n_times=n_times, threshold=threshold),
        "curves": plot_curves(trace, out_dir / "C_Q_curves.png", threshold=threshold),
    }


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].copy()


def _label(ax, layers: int, heads: int) -> None:
    ax.set_xlabel("head", fontsize=7)
    ax.set_ylabel("layer", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.set_yticks(range(0, layers, max(1, layers // 10)))
    ax.set_xticks(range(0, heads, max(1, heads // 12)))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m sinv_prune.scoring.diagnostics TRACE [--out DIR]``: print the summary as JSON, write the plots."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("trace")
    parser.add_argument("--out", help="directory for the PNG plots (default: no plots)")
    parser.add_argument("--threshold", type=float, default=None)
    args = parser.parse_args(argv)
    summary = summarize_trace(args.trace, args.threshold)
    if args.out:
        summary["plots"] = {k: str(v) for k, v in plot_trace(args.trace, args.out, threshold=args.threshold).items()}
    print(strict_json.dumps(strict_json.null_non_finite(summary)[0], indent=1))


if __name__ == "__main__":
    main()


__all__ = [
    "find_plateau",
    "layer_summary",
    "loss_series",
    "plot_curves",
    "plot_heatmaps",
    "plot_trace",
    "summarize_trace",
    "time_to_threshold",
]
