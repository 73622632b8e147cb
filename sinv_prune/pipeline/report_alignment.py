"""The ``E[b_Q]`` alignment report of a model: which tokens each head's keys point along.

:func:`alignment_report` loads a model (or takes one), ranks the vocabulary per head by
``cos(k_t, E[b_Q])`` with :func:`~sinv_prune.symmetry.alignment.alignment_table` and writes
three files into a directory:

* ``alignment.md``: one table per head, the ``top_k`` most aligned and most anti-aligned tokens
  with their cosines;
* ``alignment.json``: the setting, the summary and every row;
* ``alignment.png``: one panel per head (the first 48 heads where there are more).

``E[b_Q]`` is the mean of the model's own symmetry-breaking query bias (the active one, or the
one recorded in ``config.sinv_symmetry``). A model without a query bias gets the paper-default
mean (0.5 in every entry) and the report says so: its numbers then describe where a bias would
act, not a direction training has seen.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

from sinv_prune import strict_json
from sinv_prune.arch import get_adapter
from sinv_prune.filemodes import apply_umask
from sinv_prune.symmetry.alignment import alignment_table, mean_query_bias, plot_alignment
from sinv_prune.symmetry.biases import DEFAULT_B_Q, get_symmetry_breaking, get_symmetry_config

FILES = {"markdown": "alignment.md", "json": "alignment.json", "png": "alignment.png"}
MAX_PANELS = 48
OWN_MEAN = "the mean of the model's own symmetry-breaking query bias"


def alignment_report(
    model_or_dir: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    layer: int | Sequence[int] | None = None,
    top_k: int = 10,
    load_kwargs: Mapping | None = None,
) -> dict:
    """Write ``alignment.md``, ``alignment.json`` and ``alignment.png`` into ``out_dir``.

    ``model_or_dir``: a model, or a checkpoint directory / Hub id / ``.gguf`` path loaded with
    :func:`sinv_prune.from_pretrained` (``load_kwargs`` go to it), which restores the
    symmetry-breaking setting from ``config.sinv_symmetry``.

    ``tokenizer``: a tokenizer, a path to load one from, a vocabulary (sequence of tokens by
    id, or a mapping), or None: then the tokenizer saved with ``model_or_dir`` where it is a
    path that has one, else token ids as labels. ``layer``: one index, several, or None (all).
    ``top_k``: tokens per side per head (fewer where the vocabulary is smaller).

    Every file is written to a temporary name in ``out_dir`` and renamed into place, so a
    reader never sees a half-written file. The model is not changed.

    Returns ``{"markdown", "json", "png"}`` (paths as strings) and ``"summary"``: ``source``,
    ``b_q_source`` (``"model"`` or ``"paper default"``), ``note`` (why the default was used,
    or None), ``b_q_mean`` (per analysed layer), ``layers``, ``num_heads``, ``top_k``,
    ``plotted_heads``, and per head its most aligned and most anti-aligned token
    (``heads``: ``{"layer", "head", "kv_head", "top_token", "top_cosine", "bottom_token",
    "bottom_cosine"}``).
    """
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    source = None
    if isinstance(model_or_dir, nn.Module):
        model = model_or_dir
    else:
        from sinv_prune.surgery.checkpoint import from_pretrained

        source = os.fspath(model_or_dir)
        model = from_pretrained(source, **dict(load_kwargs or {}))
    vocab = _tokenizer(tokenizer, source)

    adapter = get_adapter(model)
    layers = list(range(adapter.num_layers)) if layer is None else [layer] if isinstance(layer, int) else list(layer)
    for index in layers:
        if not 0 <= index < adapter.num_layers:
            raise ValueError(f"layer {index} out of range: the model has {adapter.num_layers} layers")
    layers = [index for index in layers if adapter.layout(index).num_heads > 0]  # fully pruned layers have none

    means = {index: mean_query_bias(model, index) for index in layers}
    note = None
    if any(m is None for m in means.values()):
        if get_symmetry_breaking(model) is None and get_symmetry_config(model.config) is None:
            note = "the model has no symmetry breaking"
        else:
            note = "the model's symmetry breaking has no query bias (b_Q is off)"
        note += f"; used the paper-default E[b_Q] = {DEFAULT_B_Q.mean} in every entry"
        means = {index: DEFAULT_B_Q.vectors(adapter.layout(index).head_dim)[0] for index in layers}
    b_q_source = "model" if note is None else "paper default"

    rows = []
    for index in layers:
        rows += alignment_table(model, vocab, layer=index, top_k=top_k, b_q=means[index].detach().float().cpu())

    heads = sorted({(r["layer"], r["head"]) for r in rows})
    summary = {
        "source": source if source is not None else type(model).__name__,
        "model_type": getattr(model.config, "model_type", None),
        "b_q_source": b_q_source,
        "note": note,
        "b_q_mean": {str(index): [round(v, 6) for v in means[index].float().tolist()] for index in layers},
        "layers": layers,
        "num_heads": len(heads),
        "top_k": max((r["rank"] for r in rows), default=0),
        "plotted_heads": min(len(heads), MAX_PANELS),
        "heads": _head_summary(rows),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / name for kind, name in FILES.items()}
    if heads:
        _atomic(paths["png"], lambda tmp: plot_alignment(rows, tmp, title=_title(summary), max_panels=MAX_PANELS))
    else:  # nothing to draw: leave no stale plot of another model behind
        paths["png"].unlink(missing_ok=True)
    data = {"summary": summary, "rows": rows, "method": _METHOD}
    _atomic(
        paths["json"],
        lambda tmp: Path(tmp).write_text(
            strict_json.dumps(strict_json.with_null_reasons(data), indent=1) + "\n", encoding="utf-8"
        ),
    )
    _atomic(paths["markdown"], lambda tmp: Path(tmp).write_text(_markdown(summary, rows), encoding="utf-8"))
    result = {kind: str(path) for kind, path in paths.items()}
    if not heads:
        result["png"] = None
    result["summary"] = summary
    return result


_METHOD = (
    "per head h of layer l: cos(k_t, E[b_Q]) with k_t = W_K^h norm_l(e_t) + b_K^h, e_t the token's input "
    "embedding, norm_l the normalisation producing the layer's attention input; GQA: the KV head serving h; "
    "no position embeddings (rotary: relative offset 0)"
)


def _tokenizer(tokenizer, source: str | None):
    """The labeller argument for :func:`alignment_table`: a tokenizer, a vocabulary or None."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from sinv_prune.data import load_model_tokenizer

        return load_model_tokenizer(tokenizer)
    if tokenizer is not None or source is None:
        return tokenizer
    path = Path(source)
    if path.is_dir() and not any(path.glob("tokenizer*")) and not any(path.glob("vocab*")):
        return None  # transformers would build an empty tokenizer from a directory without one
    if path.is_file() and path.suffix != ".gguf":
        return None
    from sinv_prune.data import load_model_tokenizer

    try:
        return load_model_tokenizer(source)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _head_summary(rows: list[dict]) -> list[dict]:
    out = {}
    for r in rows:
        if r["rank"] != 1:
            continue
        entry = out.setdefault(
            (r["layer"], r["head"]), {"layer": r["layer"], "head": r["head"], "kv_head": r["kv_head"]}
        )
        entry[f"{r['side']}_token"] = r["token"]
        entry[f"{r['side']}_cosine"] = r["cosine"]
    return [out[key] for key in sorted(out)]


def _title(summary: dict) -> str:
    where = "E[b_Q] of the model" if summary["b_q_source"] == "model" else "paper-default E[b_Q] (model has none)"
    return f"cos(key, {where})"


def _cell(token) -> str:
    """A token as a Markdown table cell: a code span, whitespace shown escaped, pipes escaped."""
    text = repr(token)[1:-1] if isinstance(token, str) else str(token)
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fmt(value: float) -> str:
    return f"{value:+.4f}" if math.isfinite(value) else str(value)


def _markdown(summary: dict, rows: list[dict]) -> str:
    lines = [
        "# Key alignment with E[b_Q]",
        "",
        f"- model: `{summary['source']}` ({summary['model_type']})",
        f"- E[b_Q]: {summary['note'] or OWN_MEAN}",
        f"- layers: {', '.join(map(str, summary['layers'])) or 'none with heads'}; heads: {summary['num_heads']}; "
        f"top {summary['top_k']} tokens per side",
        f"- method: {_METHOD}",
        "- a positive cosine raises the head's attention score on that token for every query; a negative one lowers it",
        "",
    ]
    by_head: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by_head.setdefault((r["layer"], r["head"]), []).append(r)
    for (layer, head), mine in sorted(by_head.items()):
        kv = mine[0]["kv_head"]
        lines.append(f"## Layer {layer}, head {head}" + (f" (KV head {kv})" if kv != head else ""))
        lines.append("")
        lines.append("| rank | most aligned | cosine | most anti-aligned | cosine |")
        lines.append("| ---: | --- | ---: | --- | ---: |")
        top = {r["rank"]: r for r in mine if r["side"] == "top"}
        bottom = {r["rank"]: r for r in mine if r["side"] == "bottom"}
        for rank in sorted(top):
            t, b = top[rank], bottom[rank]
            lines.append(f"| {rank} | {_cell(t['token'])} | {_fmt(t['cosine'])} | {_cell(b['token'])} | "
                         f"{_fmt(b['cosine'])} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _atomic(path: Path, write) -> None:
    """``write(tmp_path)`` to a temporary file next to ``path``, then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        apply_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["alignment_report"]
