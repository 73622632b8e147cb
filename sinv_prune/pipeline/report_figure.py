"""The per-arm figure both report plots draw (perplexity and task accuracy, ``report.py``)."""

from __future__ import annotations


def per_arm_figure(results: dict, value, ylabel: str, *, log_y: bool = True, note: str = ""):
    """One number per model (``value(evaluation)``, None where absent): the baseline and one column per
    arm, open marker after pruning, filled after fine-tuning.

    Arms are categories, not positions on a parameter axis: arms of one size spread along a
    parameter axis (ticks 220,000 / 224,000) looked like different sizes. The parameter count is
    said once in the title when every arm has the same; otherwise under each arm's name. Arms that
    differ only by their seed share a column: the marker is their mean, the bar their range.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["baseline"]
    groups = _seed_groups(results["arms"])
    sizes = {a.get("params", a["pruned"]["params"]) for a in results["arms"]}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * (len(groups) + 1) + 2.5), 4.4), dpi=120)
    ppls = [] if value(base) is None else [value(base)]  # None: not measured (evaluate.tasks_on)
    ax.scatter([0] * len(ppls), ppls, marker="*", s=180, color="black", zorder=3)
    labels = ["baseline"]
    for x, (name, arms) in enumerate(groups, start=1):
        color = f"C{(x - 1) % 10}"
        for stage, filled in (("pruned", False), ("finetuned", True)):
            values = [value(a[stage]) for a in arms if a.get(stage) and value(a[stage]) is not None]
            if not values:
                continue
            ppls += values
            mean = sum(values) / len(values)
            style = {"color": color} if filled else {"facecolors": "white", "edgecolors": color, "linewidths": 1.5}
            ax.scatter([x], [mean], marker="o", s=50, zorder=4 if filled else 3, **style)
            if len(values) > 1:
                ax.vlines(x, min(values), max(values), color=color, linewidth=1.2, zorder=2)
        final = arms[0].get("params", arms[0]["pruned"]["params"])
        seeds = f"\n{len(arms)} seeds" if len(arms) > 1 else ""
        size = "" if len(sizes) == 1 else f"\n{final:,} ({100 * final / base['params']:.1f}%)"
        labels.append(name + seeds + size)
    ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 4 else 0, ha="right" if
                  len(labels) > 4 else "center", fontsize=7)  # fmt: skip
    ax.set_xlim(-0.6, len(labels) - 0.4)
    if log_y:
        _plain_y(ax, ppls)
    (size,) = sizes if len(sizes) == 1 else (None,)
    title = [note] if note else []
    if size is not None:
        title.append(f"every arm keeps {size:,} parameters ({100 * size / base['params']:.1f}% of the baseline's "
                     f"{base['params']:,})")  # fmt: skip
    if title:
        ax.set_title("\n".join(title), fontsize=8)
    ax.scatter([], [], marker="o", s=50, facecolors="white", edgecolors="gray", label="after pruning")
    if any(a.get("finetuned") for a in results["arms"]):
        ax.scatter([], [], marker="o", s=50, color="gray", label="after fine-tuning")
    if any(len(arms) > 1 for _, arms in groups):
        ax.vlines([], [], [], color="gray", label="range over seeds")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def _seed_groups(arms: list[dict]) -> list[tuple[str, list[dict]]]:
    """Arms in recipe order, those that differ only by ``seed`` (and name) together: ``[(name, arms)]``."""
    groups: dict[str, tuple[str, list[dict]]] = {}
    for arm in arms:
        same = {k: v for k, v in arm.items() if k in ("criterion", "unit", "amount", "mode", "layout", "options",
                                                     "parts", "compensate", "rounds")}  # fmt: skip
        key = repr(sorted(same.items())) if arm.get("seed") is not None else arm["name"]
        groups.setdefault(key, (arm["name"], []))[1].append(arm)
    return [(name if len(members) == 1 else _common_name(members), members) for name, members in groups.values()]


def _common_name(arms: list[dict]) -> str:
    """The arms' names without the seed: their longest common prefix (less a trailing ``-seed`` / ``-s``)."""
    import os
    import re

    prefix = re.sub(r"[-_ ]*(seed|s)?$", "", os.path.commonprefix([a["name"] for a in arms]))
    return prefix or arms[0]["name"]


def _plain_y(ax, perplexities: list[float]) -> None:
    """Plain-number tick labels; a log y axis only when perplexities span more than a factor of 3."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if max(perplexities) > 3 * min(perplexities):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.margins(y=0.08)
    ax.autoscale_view()
