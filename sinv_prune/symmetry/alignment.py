"""Which tokens a head's keys point along ``E[b_Q]``: the paper's interpretability analysis.

With the query bias in place, the score of a key ``k_t`` gains ``E[b_Q] . k_t / sqrt(d)``
independently of the query: tokens whose keys align with ``E[b_Q]`` are attended to more
by that head, anti-aligned ones less. Per head ``h`` of layer ``l`` this module ranks the
vocabulary by ``cos(k_t, E[b_Q])`` with

    k_t = W_K^h norm_l(e_t) + b_K^h

where ``e_t`` is the token's input embedding and ``norm_l`` the normalisation that produces
the layer's attention input (GPT-2 ``ln_1``, LLaMA ``input_layernorm``; BERT is post-norm,
so the previous block's output ``LayerNorm``, or the embeddings' ``LayerNorm`` for layer 0).
The paper's code skips the normalisation; position and token-type embeddings are left out,
as there. Under grouped-query attention ``W_K^h`` is the KV head serving ``h``; where the
attention normalises keys per head (``k_norm``) that is applied too. Under rotary
embeddings this is the alignment at relative offset 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.symmetry.biases import get_symmetry_breaking, get_symmetry_config


def input_norm(model: nn.Module, layer: int) -> nn.Module:
    """The normalisation whose output is ``layer``'s attention input (identity if there is none)."""
    adapter = get_adapter(model)
    block = adapter.layers()[layer]
    for name in ("ln_1", "input_layernorm"):
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    if adapter.name == "bert":  # post-norm: the previous block's output LayerNorm
        if layer == 0:
            return adapter.base.embeddings.LayerNorm
        return adapter.layers()[layer - 1].output.LayerNorm
    return nn.Identity()


def mean_query_bias(model: nn.Module, layer: int) -> torch.Tensor | None:
    """``E[b_Q]`` of ``layer``: from the active symmetry breaking, else from the config record."""
    handle = get_symmetry_breaking(model)
    if handle is not None:
        return handle.mean(layer, "q")
    setting = get_symmetry_config(model.config)
    if setting is None or setting.b_q is None:
        return None
    return setting.b_q.vectors(get_adapter(model).layout(layer).head_dim)[0]


@torch.no_grad()
def key_cosines(model: nn.Module, layer: int, b_q: torch.Tensor | None = None, chunk: int = 8192) -> torch.Tensor:
    """``[num_heads, vocab]``: ``cos(k_t, E[b_Q])`` for every query head of ``layer`` and every token."""
    adapter = get_adapter(model)
    layout = adapter.layout(layer)
    if b_q is None:
        b_q = mean_query_bias(model, layer)
        if b_q is None:
            raise ValueError("the model has no query bias (add_symmetry_breaking) and no b_q was given")
    b_q = torch.as_tensor(b_q).float()
    if b_q.shape != (layout.head_dim,):
        raise ValueError(f"b_q must have head_dim={layout.head_dim} entries, got shape {tuple(b_q.shape)}")
    emb = model.get_input_embeddings().weight
    if layout.num_heads == 0:
        return emb.new_zeros(0, emb.shape[0], dtype=torch.float32)
    proj = adapter.projections(layer)
    w_k = proj.k.float()
    b_k = proj.k_bias.float() if proj.k_bias is not None else None
    norm = input_norm(model, layer)
    k_norm = getattr(adapter.attention(layer), "k_norm", None)
    kv_of_head = torch.arange(layout.num_heads) // layout.group_size
    out = []
    for start in range(0, emb.shape[0], chunk):
        x = norm(emb[start : start + chunk]).float()
        keys = F.linear(x.to(w_k.device), w_k, b_k).unflatten(-1, (layout.num_kv_heads, layout.head_dim))
        if isinstance(k_norm, nn.Module):
            keys = k_norm(keys.to(emb.dtype)).float()
        cos = F.cosine_similarity(keys, b_q.to(keys.device), dim=-1)  # [chunk, kv]
        out.append(cos[:, kv_of_head.to(cos.device)].T.cpu())
    return torch.cat(out, dim=1)


def alignment_table(
    model: nn.Module,
    tokenizer_or_vocab=None,
    layer: int | Sequence[int] | None = None,
    top_k: int = 10,
    *,
    b_q: torch.Tensor | None = None,
) -> list[dict]:
    """Per head, the ``top_k`` tokens whose keys align most and least with ``E[b_Q]``.

    ``tokenizer_or_vocab``: a tokenizer (``convert_ids_to_tokens``), a sequence of token
    strings indexed by id, a mapping id -> token (or token -> id, as ``get_vocab()``), or
    None (ids as labels). ``layer``: one index, several, or None for all. ``b_q``: override
    ``E[b_Q]`` (a ``head_dim`` vector); by default it comes from the model's symmetry breaking.

    Returns one row per (layer, head, side, rank): ``{"layer", "head", "kv_head", "side"
    ("top" | "bottom"), "rank" (1 = most extreme), "token_id", "token", "cosine"}``.
    """
    adapter = get_adapter(model)
    layers = range(adapter.num_layers) if layer is None else [layer] if isinstance(layer, int) else list(layer)
    label = _labeller(tokenizer_or_vocab)
    rows = []
    for l in layers:  # noqa: E741
        cos = key_cosines(model, l, b_q)
        group = adapter.layout(l).group_size
        k = min(top_k, cos.shape[1])
        for h in range(cos.shape[0]):
            for side, largest in (("top", True), ("bottom", False)):
                values, ids = cos[h].topk(k, largest=largest)
                for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
                    rows.append({
                        "layer": l, "head": h, "kv_head": h // group, "side": side, "rank": rank,
                        "token_id": tid, "token": label(tid), "cosine": value,
                    })  # fmt: skip
    return rows


def plot_alignment(rows: list[dict], path: str | os.PathLike, *, title: str | None = None, max_panels: int = 48) -> str:
    """A PNG with one panel per head: the top tokens' cosines (right) and the bottom ones' (left).

    ``rows`` as returned by :func:`alignment_table` (filter them to choose heads); at most
    ``max_panels`` heads are drawn. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    heads = sorted({(r["layer"], r["head"]) for r in rows})
    if not heads:
        raise ValueError("no rows to plot")
    shown = heads[:max_panels]
    top_k = max(r["rank"] for r in rows)
    cols = min(4, len(shown))
    nrows = -(-len(shown) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 0.9 + 0.26 * 2 * top_k * nrows), squeeze=False)
    for ax, (layer, head) in zip(axes.flat, shown, strict=False):
        mine = [r for r in rows if (r["layer"], r["head"]) == (layer, head)]
        top = sorted((r for r in mine if r["side"] == "top"), key=lambda r: r["rank"], reverse=True)
        bottom = sorted((r for r in mine if r["side"] == "bottom"), key=lambda r: r["rank"])
        ordered = bottom + top
        values = [r["cosine"] for r in ordered]
        ax.barh(range(len(ordered)), values, color=["tab:blue" if v < 0 else "tab:red" for v in values])
        ax.set_yticks(range(len(ordered)), [_short(r["token"]) for r in ordered], fontsize=7)
        ax.set_xlim(-1, 1)
        ax.axvline(0, color="black", linewidth=0.5)
        kv = mine[0]["kv_head"]
        ax.set_title(f"layer {layer} head {head}" + (f" (KV head {kv})" if kv != head else ""), fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    note = f" ({len(shown)} of {len(heads)} heads)" if len(shown) < len(heads) else ""
    fig.suptitle((title or "cos(key, E[b_Q]) per head") + note, fontsize=10)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(token: str, width: int = 14) -> str:
    token = repr(token)[1:-1] if isinstance(token, str) else str(token)
    return token if len(token) <= width else token[: width - 1] + "…"


def _labeller(vocab):
    if vocab is None:
        return str
    if hasattr(vocab, "convert_ids_to_tokens"):

        def from_tokenizer(tid: int) -> str:
            try:
                token = vocab.convert_ids_to_tokens(tid)
            except (IndexError, KeyError, ValueError, TypeError):
                token = None
            return token if token is not None else f"[{tid}]"

        return from_tokenizer
    if isinstance(vocab, Mapping):
        if vocab and all(isinstance(k, str) for k in vocab):  # token -> id, as tokenizer.get_vocab()
            vocab = {v: k for k, v in vocab.items()}
        return lambda tid: str(vocab.get(tid, f"[{tid}]"))
    if isinstance(vocab, Sequence):
        return lambda tid: str(vocab[tid]) if tid < len(vocab) else f"[{tid}]"
    kind = type(vocab).__name__
    raise TypeError(f"tokenizer_or_vocab must be a tokenizer, a sequence, a mapping or None, not {kind}")
