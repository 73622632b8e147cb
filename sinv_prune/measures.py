"""S-invariant measures of attention heads and MLPs (paper: NN6, "The S-Invariant Attractor").

The paper's measures, all in ``[0, 1]``, 0 at its attractor:

* ``C_Q(W_Q, W_K) = ||W_Q + W_K||_F / (||W_Q||_F + ||W_K||_F)`` per head;
* ``C(W) = ||W + W^T||_F / (2 ||W||_F)`` for a square ``W`` (the paper's ``C_V`` and ``C_FF``).

Per-head value slices and MLP weights are not square, so ``C`` is applied to square forms
that keep the paper's meaning (recorded under ``"meta"`` in every result):

* ``C_V``: per head, the OV circuit ``W_O^h W_V^h`` (``d_model x d_model``);
* ``C_V_layer``: per layer, ``W_V`` itself where it is square (else ``None``);
* ``C_FF``: per layer, the MLP's linear path ``W_out W_in`` (gated MLPs: ``W_down W_up``).

``C_QK_gauge`` is a gauge-invariant variant of ``C_Q``: attention is unchanged by
``W_Q^h -> A W_Q^h, W_K^h -> A^{-T} W_K^h`` for any invertible ``A``, which leaves
``M = W_Q^h^T W_K^h`` unchanged; at the attractor ``W_Q = -W_K`` that ``M`` is symmetric
negative semi-definite. The measure is ``||M - P(M)||_F / ||M||_F`` with ``P`` the projection
onto that cone.

Nothing ``d_model x d_model`` is formed per head: every per-head quantity is computed
exactly in the (at most ``2 d_head``-dimensional) subspace that carries the head's
matrices. This is also more accurate than trace identities such as
``||W+W^T||^2 = 2||W||^2 + 2 tr(W^2)``, which cancel catastrophically near the attractor
(in float32 they are off by ~2e-4 near 0, e.g. 0.0 or 2.6e-4 for a true 1e-4; the subspace form
by ~1e-7).

Non-finite weights give NaN (``json.dumps`` writes it as ``NaN``) for the heads or layers they touch.

Zero-norm convention: a measure whose denominator is exactly zero (all weights involved
are zero) is reported as ``0.0``. Zero matrices satisfy every attractor condition exactly
(``0 = -0``, ``0 = -0^T``, ``0`` is symmetric NSD), the numerators are 0, and such a head
contributes nothing, which is what a 0 is used to signal (a prune candidate).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from sinv_prune.arch import get_adapter

__all__ = [
    "ALL_KEYS",
    "c_product",
    "c_q",
    "c_qk_gauge",
    "c_square",
    "head_measures",
    "layer_measures",
    "measure_summary",
]

PER_HEAD_KEYS = ("C_Q", "C_V", "C_QK_gauge")
PER_LAYER_KEYS = ("C_V_layer", "C_FF")
ALL_KEYS = PER_HEAD_KEYS + PER_LAYER_KEYS

FORMS = {
    "C_Q": "||W_Q^h + W_K^h||_F / (||W_Q^h||_F + ||W_K^h||_F), d_head x d_model slices, "
    "GQA: key slice of the KV head serving h, biases excluded (paper's exact formula)",
    "C_V": "C(W) = ||W + W^T||_F / (2||W||_F) on the OV circuit W = W_O^h W_V^h (d_model x d_model), "
    "GQA: value slice of the KV head serving h",
    "C_V_layer": "C(W_V) on the layer's W_V itself where it is square (KV*d_head == d_model), else null "
    "(paper's exact formula)",
    "C_FF": "C(W) on the MLP's linear path W = W_out W_in (gated: W_down W_up)",
    "C_QK_gauge": "||M - P(M)||_F / ||M||_F, M = W_Q^h^T W_K^h, P = projection onto symmetric NSD matrices; "
    "invariant under W_Q -> A W_Q, W_K -> A^-T W_K",
    "zero_norm": "0.0 where the denominator is exactly zero (zero weights satisfy the attractor condition)",
    "non_finite": "NaN where the weights involved are not finite",
    "dtype": "float32, whatever the model dtype",
}


# -- batched kernels (leading dimension = heads) ------------------------------------------


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` clamped to [0, 1], 0 where ``den == 0`` (zero-norm convention); NaN stays NaN."""
    zero = den == 0
    return torch.where(zero, torch.zeros_like(num), num / torch.where(zero, torch.ones_like(den), den)).clamp(0, 1)


def _finite(*blocks: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-head mask of finite inputs, and the blocks with non-finite heads zeroed (LAPACK rejects NaN)."""
    ok = torch.stack([torch.isfinite(b).flatten(1).all(1) for b in blocks]).all(0)
    return ok, [torch.where(ok[:, None, None], b, torch.zeros_like(b)) for b in blocks]


def _coordinates(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``U^T a`` and ``U^T b`` for ``[n, D, r]`` blocks, ``U`` an orthonormal basis of their joint span.

    From the triangular factor of ``[a, b] = U R`` (Householder QR, ``U`` never formed), so
    ``[k, r]`` with ``k = min(D, 2r)``; orthogonal, hence exact up to rounding of order ``eps ||a|| ||b||``.
    """
    r = torch.linalg.qr(torch.cat([a, b], dim=-1), mode="r").R
    return r[..., : a.shape[-1]], r[..., a.shape[-1] :]


def c_q(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """Paper's ``C_Q`` per head from ``[n, d, D]`` query and key slices; ``[n]``."""
    num = torch.linalg.matrix_norm(wq + wk)
    return _ratio(num, torch.linalg.matrix_norm(wq) + torch.linalg.matrix_norm(wk))


def c_square(w: torch.Tensor) -> torch.Tensor:
    """Paper's ``C(W) = ||W + W^T||_F / (2||W||_F)`` for square ``[..., n, n]`` matrices."""
    return _ratio(torch.linalg.matrix_norm(w + w.mT), 2 * torch.linalg.matrix_norm(w))


def c_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``C(left @ right)`` for ``[n, D, r] @ [n, r, D]`` without forming ``D x D``.

    Both the column space (in ``col(left)``) and the row space (in ``col(right^T)``) of
    ``W = left @ right`` lie in ``S = col([left, right^T])``; with ``U`` an orthonormal basis
    of ``S``, ``w = (U^T left)(U^T right^T)^T`` (at most ``2r x 2r``) has the same Frobenius
    norm as ``W`` and ``w + w^T`` as ``W + W^T``.
    """
    ok, (left, right) = _finite(left, right)
    left_u, right_u = _coordinates(left, right.mT)
    return torch.where(ok, c_square(left_u @ right_u.mT), torch.nan)


def c_qk_gauge(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """Gauge-invariant ``C_Q`` per head from ``[n, d, D]`` slices; ``[n]``.

    ``M = W_Q^T W_K`` is represented exactly by ``m = U^T M U = (U^T W_Q^T)(U^T W_K^T)^T`` with
    ``U`` an orthonormal basis of the row spaces of ``W_Q`` and ``W_K`` (at most ``2d x 2d``);
    ``||M - P(M)||^2 = ||skew(m)||^2 + sum(relu(eig(sym(m)))^2)``.
    """
    ok, (wq, wk) = _finite(wq, wk)
    q_u, k_u = _coordinates(wq.mT, wk.mT)
    m = q_u @ k_u.mT
    sym, skew = (m + m.mT) / 2, (m - m.mT) / 2
    positive = torch.linalg.eigvalsh(sym).clamp(min=0)
    dist = torch.sqrt(torch.linalg.matrix_norm(skew) ** 2 + (positive**2).sum(-1))
    return torch.where(ok, _ratio(dist, torch.linalg.matrix_norm(m)), torch.nan)


# -- per layer ----------------------------------------------------------------------------


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32)


def _mlp_measure(weights: Sequence[torch.Tensor]) -> float | None:
    """``C`` of the product of the MLP's linear path (``[out, in]`` weights, input side first)."""
    if not weights:
        return None
    w = _f32(weights[0])
    for nxt in weights[1:]:
        w = _f32(nxt).to(w.device) @ w
    if w.shape[0] != w.shape[1]:
        return None
    return float(c_square(w))


def layer_measures(adapter, layer: int, keys: Iterable[str] = ALL_KEYS) -> dict:
    """The measures of one layer through its adapter; per-head values as lists of floats."""
    keys = set(keys)
    layout = adapter.layout(layer)
    heads, kv, d, group = layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.group_size
    out: dict = {}
    if "C_FF" in keys:
        out["C_FF"] = _mlp_measure(adapter.mlp(layer))
    if heads == 0:
        out.update({k: [] for k in PER_HEAD_KEYS if k in keys})
        if "C_V_layer" in keys:
            out["C_V_layer"] = None
        return out

    proj = adapter.projections(layer)
    dim = proj.q.shape[1]
    serving = torch.arange(heads, device=proj.q.device) // group  # KV head serving each query head
    wq = _f32(proj.q).reshape(heads, d, dim)
    if "C_Q" in keys or "C_QK_gauge" in keys:
        wk = _f32(proj.k).reshape(kv, d, dim).index_select(0, serving)
        if "C_Q" in keys:
            out["C_Q"] = c_q(wq, wk).tolist()
        if "C_QK_gauge" in keys:
            out["C_QK_gauge"] = c_qk_gauge(wq, wk).tolist()
    if "C_V" in keys:
        wv = _f32(proj.v).reshape(kv, d, dim).index_select(0, serving)  # [H, d, D]
        wo = _f32(proj.o).reshape(dim, heads, d).permute(1, 0, 2)  # [H, D, d]
        out["C_V"] = c_product(wo, wv).tolist()
    if "C_V_layer" in keys:
        v = proj.v
        out["C_V_layer"] = float(c_square(_f32(v))) if v.shape[0] == v.shape[1] else None
    return out


# -- public API ---------------------------------------------------------------------------


@torch.no_grad()
def head_measures(model: nn.Module, keys: Iterable[str] | None = None) -> dict:
    """S-invariant measures of every head and layer of ``model``, as a JSON-serialisable dict.

    Keys (each a list over layers; see the module docstring for the forms):
    ``"C_Q"``, ``"C_V"``, ``"C_QK_gauge"``: per layer a list per query head (empty for a
    layer without heads); ``"C_V_layer"``: per layer a float or ``None`` (``W_V`` not square);
    ``"C_FF"``: per layer a float; ``"meta"``: the form of each number and the layer head counts.
    Computed in float32 on each layer's own device, whatever the model's dtype; heads are
    numbered as the (possibly pruned) layers have them now. ``keys`` limits the computation
    to a subset of the measures (``"meta"`` is always present).
    """
    adapter = get_adapter(model)
    wanted = ALL_KEYS if keys is None else tuple(keys)
    unknown = set(wanted) - set(ALL_KEYS)
    if unknown:
        raise ValueError(f"unknown measures {sorted(unknown)}; choose from {list(ALL_KEYS)}")
    result: dict = {k: [] for k in ALL_KEYS if k in wanted}
    layouts = [adapter.layout(i) for i in range(adapter.num_layers)]
    for layer in range(adapter.num_layers):
        values = layer_measures(adapter, layer, wanted)
        for k in result:
            result[k].append(values[k])
    result["meta"] = {
        "forms": {k: v for k, v in FORMS.items() if k in result or k not in ALL_KEYS},
        "num_heads": [lay.num_heads for lay in layouts],
        "num_kv_heads": [lay.num_kv_heads for lay in layouts],
        "head_dim": [lay.head_dim for lay in layouts],
    }
    return result


def _stats(values: Sequence[float]) -> dict:
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": math.fsum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def measure_summary(measures: dict) -> dict:
    """Per-layer and overall mean / min / max of each per-head measure present (for logs).

    ``{"C_Q": {"layers": [{"mean", "min", "max", "n"}, ...], "all": {...}}, ...}``; an empty
    layer gives ``None`` statistics and ``n = 0``.
    """
    summary = {}
    for key in PER_HEAD_KEYS:
        if key not in measures:
            continue
        per_layer = measures[key]
        summary[key] = {
            "layers": [_stats(values) for values in per_layer],
            "all": _stats([v for values in per_layer for v in values]),
        }
    return summary
