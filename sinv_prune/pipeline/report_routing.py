"""The report's expert-routing part for a mixture-of-experts run: a figure per arm and a table.

Each figure (``plots/routing_<arm>.png``) has one panel per MoE layer of the original model: per
expert (original numbering), its share of the router's top-k choices on the evaluation text for
the baseline, the pruned model and the fine-tuned one; removed experts are shaded and marked
``x`` (their share after pruning is 0); the dashed line is the balanced share ``1 / num_experts``.
The numbers come from ``routing`` in each model's evaluation (:mod:`sinv_prune.pipeline.routing`).
"""

from __future__ import annotations

from pathlib import Path

#: Bar colours: baseline, after pruning, after fine-tuning.
COLORS = {"baseline": "0.55", "pruned": "C1", "finetuned": "C0"}
LABELS = {"baseline": "baseline", "pruned": "pruned", "finetuned": "fine-tuned"}
#: Inches above the panels for the title and the legend.
HEADER_IN = 0.6


def has_routing(results: dict) -> bool:
    return bool(results.get("baseline", {}).get("routing"))


def plot_routing(results: dict, plots_dir: Path) -> dict[str, Path]:
    """One PNG per arm whose evaluations carry routing statistics: ``{arm name: path}``."""
    if not has_routing(results):
        return {}
    out = {}
    for arm in results["arms"]:
        if not arm.get("pruned", {}).get("routing"):
            continue
        path = plots_dir / f"routing_{_safe(arm['name'])}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = routing_figure(results["baseline"]["routing"], arm)
        fig.savefig(path)
        import matplotlib.pyplot as plt

        plt.close(fig)
        out[arm["name"]] = path
    return out


def routing_figure(baseline: dict, arm: dict):
    """Per MoE layer, each expert's selection share: baseline vs the arm after pruning (and fine-tuning)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [("baseline", baseline)] + [(s, arm[s]["routing"]) for s in ("pruned", "finetuned")
                                         if arm.get(s, {}).get("routing")]  # fmt: skip
    layers = sorted(baseline["layers"], key=int)
    experts = baseline["num_experts"]
    width = 0.8 / len(stages)
    height = 1.9 * len(layers) + 0.5 + HEADER_IN
    fig, axes = plt.subplots(len(layers), 1, figsize=(max(6.0, 0.45 * experts + 2.0), height), dpi=110,
                             sharex=True, squeeze=False)  # fmt: skip
    for ax, layer in zip(axes[:, 0], layers, strict=True):
        removed = next((r["layers"][layer]["removed"] for s, r in stages[1:] if layer in r["layers"]), [])
        for e in removed:
            ax.axvspan(e - 0.5, e + 0.5, color="C3", alpha=0.12, linewidth=0)
        for k, (stage, routing) in enumerate(stages):
            row = routing["layers"].get(layer)
            if row is None:  # the arm removed the whole layer
                continue
            x = [e - 0.4 + width * (k + 0.5) for e in range(experts)]
            ax.bar(x, row["share"], width=width, color=COLORS[stage], label=LABELS[stage])
        ax.scatter(removed, [0] * len(removed), marker="x", color="C3", s=28, zorder=4,
                   label="removed" if removed else None, clip_on=False)  # fmt: skip
        ax.axhline(1 / experts, color="black", linestyle="--", linewidth=0.8, label=f"balanced (1/{experts})")
        effective = [f"{LABELS[s]} {r['layers'][layer]['effective_experts']:.1f}" for s, r in stages
                     if layer in r["layers"] and r["layers"][layer]["effective_experts"] is not None]  # fmt: skip
        ax.set_title(f"layer {layer}: effective experts {', '.join(effective)}", fontsize=8, loc="left")
        ax.set_ylabel("share", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    axes[-1, 0].set_xticks(range(experts))
    axes[-1, 0].set_xlim(-0.6, experts - 0.4)
    axes[-1, 0].set_xlabel("expert (original numbering)", fontsize=8)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for ax in axes[1:, 0]:  # "removed" may first appear in a later layer
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    top = 1 - HEADER_IN / height
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, top), fontsize=7, ncol=len(labels),
               frameon=False)  # fmt: skip
    tokens = baseline["tokens"]
    fig.suptitle(f"{arm['name']}: share of the router's top-{baseline['top_k']} choices per expert "
                 f"({tokens:,} tokens)", fontsize=9, x=0.01, y=0.995, ha="left", va="top")  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def routing_lines(results: dict, figures: dict[str, str]) -> list[str]:
    """report.md's ``## Expert routing`` section (empty for a dense model): a table and the figures' links."""
    if not has_routing(results):
        return []
    base = results["baseline"]["routing"]
    split = results.get("run", {}).get("eval_split", "evaluation")
    lines = [
        "## Expert routing",
        "",
        f"How often the router picks each expert (its share of the top-{base['top_k']} choices) on "
        f"{base['tokens']:,} tokens of the `{split}` split, per MoE layer, in the original expert numbering. "
        f"Effective experts: exp(entropy of the shares), from 1 (one expert takes every token) to the experts "
        f"kept (balanced); mean over MoE layers. Largest share: the busiest expert of any layer "
        f"(balanced: 1/{base['num_experts']} = {1 / base['num_experts']:.3f} before pruning).",
        "",
        "| model | experts kept per layer | effective experts | largest share | figure |",
        "| --- | --- | --- | --- | --- |",
        _routing_row("baseline", base, None),
    ]
    for arm in results["arms"]:
        for stage in ("pruned", "finetuned"):
            routing = arm.get(stage, {}).get("routing")
            if routing:
                link = figures.get(arm["name"]) if stage == "pruned" else None
                lines.append(_routing_row(f"{arm['name']} ({LABELS[stage]})", routing, link))
    return lines


def _routing_row(name: str, routing: dict, link: str | None) -> str:
    rows = list(routing["layers"].values())
    kept = sorted({routing["num_experts"] - len(r["removed"]) for r in rows})
    kept_text = str(kept[0]) if len(kept) == 1 else f"{kept[0]}-{kept[-1]}"
    effective = [r["effective_experts"] for r in rows if r["effective_experts"] is not None]
    mean = f"{sum(effective) / len(effective):.2f}" if effective else "-"
    largest = max(max(r["share"]) for r in rows)
    figure = f"[routing]({link})" if link else ""
    return f"| {name} | {kept_text} of {routing['num_experts']} | {mean} | {largest:.3f} | {figure} |"


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)
