"""S-invariant measures of attention heads and MLPs (paper: NN6, "The S-Invariant Attractor").

The paper's measures, all in ``[0, 1]``, 0 at its attractor:

* ``C_Q(W_Q, W_K) = ||W_Q + W_K||_F / (||W_Q||_F + ||W_K||_F)`` per head;
* ``C(W) = ||W + W^T||_F / (2 ||W||_F)`` for a square ``W`` (the paper's ``C_V`` and ``C_FF``).

Per-head value slices and MLP weights are not square, so ``C`` is applied to square forms
that keep the paper's meaning (recorded under ``"meta"`` in every result):

* ``C_V``: per head, the OV circuit ``W_O^h W_V^h`` (``d_model x d_model``);
* ``C_V_layer``: per layer, ``W_V`` itself where it is square (else ``None``);
* ``C_FF``: per layer, the MLP's linear path ``W_out W_in`` (gated MLPs: ``W_down W_up``);
* ``C_FF_experts``: per mixture-of-experts layer, ``C_FF`` of every routed expert's ``W_down W_up``
  (a MoE layer's ``C_FF`` is ``None``: it has no dense MLP). Only models with experts carry it.

``C_QK_gauge`` is a gauge-invariant variant of ``C_Q``: attention is unchanged by
``W_Q^h -> A W_Q^h, W_K^h -> A^{-T} W_K^h`` for any invertible ``A``, which leaves
``M = W_Q^h^T W_K^h`` unchanged; at the attractor ``W_Q = -W_K`` that ``M`` is symmetric
negative semi-definite. The measure is ``||M - P(M)||_F / ||M||_F`` with ``P`` the projection
onto that cone.

Nothing ``d_model x d_model`` is formed per head, and every head of a layer is computed
at once (batched matrix products over the heads; under GQA, query heads grouped with the
KV head serving them). Per head, only ``d_head x d_head`` Gram blocks of the slices are
formed, in float64: ``C_V`` from ``||W||^2 = <W_O^T W_O, W_V W_V^T>`` and
``tr(W^2) = tr((W_V W_O)^2)``; ``C_QK_gauge`` from the blocks of ``G = [W_Q; W_K][W_Q; W_K]^T``
(its norms the same way, the positive eigenvalues of ``sym(M)`` from the ``2 d_head x 2 d_head``
matrix ``R J R^T`` with ``G = R^T R`` a Cholesky factor). float64 matters: in float32 the trace
identity ``||W+W^T||^2 = 2||W||^2 + 2 tr(W^2)`` cancels catastrophically near the attractor
(off by ~2e-4 near 0); in float64 by ~1e-8 at worst. The positive part uses ``eigvalsh`` on the CPU and,
on an accelerator (where batched eigensolvers of this size run one matrix at a time), a
Newton-Schulz sign iteration made of batched matrix products. ``C_FF``'s ``W_down W_up``
product is the one ``d_model x d_model`` matrix formed per layer; on CUDA, half-precision
weights multiply in their own dtype with float32 accumulation and output (exact inputs).

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
    "EXPERT_KEYS",
    "c_product",
    "c_q",
    "c_qk_gauge",
    "c_square",
    "expert_measures",
    "head_measures",
    "layer_measures",
    "measure_summary",
]

PER_HEAD_KEYS = ("C_Q", "C_V", "C_QK_gauge")
PER_LAYER_KEYS = ("C_V_layer", "C_FF")
ALL_KEYS = PER_HEAD_KEYS + PER_LAYER_KEYS
#: Per-expert keys: computed for models with experts (or when asked for), absent from dense models' results.
EXPERT_KEYS = ("C_FF_experts",)

FORMS = {
    "C_Q": "||W_Q^h + W_K^h||_F / (||W_Q^h||_F + ||W_K^h||_F), d_head x d_model slices, "
    "GQA: key slice of the KV head serving h, biases excluded (paper's exact formula)",
    "C_V": "C(W) = ||W + W^T||_F / (2||W||_F) on the OV circuit W = W_O^h W_V^h (d_model x d_model), "
    "GQA: value slice of the KV head serving h",
    "C_V_layer": "C(W_V) on the layer's W_V itself where it is square (KV*d_head == d_model), else null "
    "(paper's exact formula)",
    "C_FF": "C(W) on the MLP's linear path W = W_out W_in (gated: W_down W_up)",
    "C_FF_experts": "C_FF per routed expert, W = W_down^e W_up^e (d_model x d_model, not formed); "
    "a list per layer, empty for a dense layer",
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


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` in float64 for ``[n, r, D]`` and ``[n, s, D]`` row blocks; ``[n, r, s]``."""
    return _f64(a) @ _f64(b).mT


def _inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``tr(a^T b)`` over the last two dimensions."""
    return (a * b).sum((-2, -1))


def _finite_heads(*grams: torch.Tensor) -> torch.Tensor:
    """Per-head mask: all Gram entries finite (a non-finite weight makes its Gram entries inf/NaN)."""
    return torch.stack([torch.isfinite(g).flatten(1).all(1) for g in grams]).all(0)


def _c_from_grams(norm_sq: torch.Tensor, trace_sq: torch.Tensor) -> torch.Tensor:
    """``C(W)`` from ``||W||^2`` and ``tr(W^2)``: ``sqrt(2||W||^2 + 2 tr(W^2)) / (2||W||)``."""
    num = torch.sqrt((2 * norm_sq + 2 * trace_sq).clamp(min=0))
    return _ratio(num, 2 * torch.sqrt(norm_sq.clamp(min=0)))


def c_q(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """Paper's ``C_Q`` per head from ``[n, d, D]`` query and key slices; ``[n]``."""
    num = torch.linalg.matrix_norm(wq + wk)
    return _ratio(num, torch.linalg.matrix_norm(wq) + torch.linalg.matrix_norm(wk))


def c_square(w: torch.Tensor) -> torch.Tensor:
    """Paper's ``C(W) = ||W + W^T||_F / (2||W||_F)`` for square ``[..., n, n]`` matrices."""
    return _ratio(torch.linalg.matrix_norm(w + w.mT), 2 * torch.linalg.matrix_norm(w))


def c_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``C(left @ right)`` for ``[n, D, r] @ [n, r, D]`` without forming ``D x D``; ``[n]``.

    ``||W||^2 = <left^T left, right right^T>`` and ``tr(W^2) = tr((right left)^2)``, all
    ``r x r`` and in float64.
    """
    return _c_product_grams(_gram(left.mT, left.mT), _gram(right, right), _gram(right, left.mT))


def _c_product_grams(ll: torch.Tensor, rr: torch.Tensor, rl: torch.Tensor) -> torch.Tensor:
    """``C(left @ right)`` from ``left^T left``, ``right right^T`` and ``right left`` (float64)."""
    ok = _finite_heads(ll, rr, rl)
    ll, rr, rl = (torch.where(ok[:, None, None], g, 0) for g in (ll, rr, rl))
    out = _c_from_grams(_inner(ll, rr), _inner(rl, rl.mT))
    return torch.where(ok, out, torch.nan).float()


def _positive_sq_eigvalsh(sym: torch.Tensor) -> torch.Tensor:
    """``sum(relu(eig(sym))^2)`` per matrix, by a batched symmetric eigensolver."""
    return (torch.linalg.eigvalsh(sym).clamp(min=0) ** 2).sum(-1)


NEWTON_SCHULZ_STEPS = 60


def _positive_sq_newton_schulz(sym: torch.Tensor, steps: int = NEWTON_SCHULZ_STEPS) -> torch.Tensor:
    """``sum(relu(eig(sym))^2)`` per matrix from ``P_+ = (T + T sign(T)) / 2``, matrix products only.

    ``sign(T)`` by ``X <- X (3I - X^2) / 2`` from ``X = T / ||T||_F``: an eigenvalue ``x`` grows by
    1.5x per step until it converges, so after ``steps`` only eigenvalues below
    ``1.5^-(steps - 8) ||T||_F`` (~7e-10 for 60 steps) are unresolved; each adds at most its own
    square, which is negligible. Batched products beat the one-matrix-at-a-time eigensolvers
    accelerators run for matrices above 32 x 32.
    """
    scale = torch.linalg.matrix_norm(sym)
    x = sym / torch.where(scale == 0, 1, scale)[:, None, None]
    for _ in range(steps):
        x = 1.5 * x - 0.5 * (x @ (x @ x))
    positive = (sym + sym @ x) / 2
    return torch.linalg.matrix_norm((positive + positive.mT) / 2) ** 2


def _positive_sq(sym: torch.Tensor) -> torch.Tensor:
    return _positive_sq_eigvalsh(sym) if sym.device.type == "cpu" else _positive_sq_newton_schulz(sym)


def c_qk_gauge(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """Gauge-invariant ``C_Q`` per head from ``[n, d, D]`` slices; ``[n]``.

    With ``M = W_Q^T W_K``: ``||M||^2 = <W_Q W_Q^T, W_K W_K^T>``, ``tr(M^2) = tr((W_K W_Q^T)^2)``,
    ``||skew(M)||^2 = (||M||^2 - tr(M^2)) / 2``; ``sym(M) = X^T J X`` with ``X = [W_Q; W_K]`` and
    ``J = [[0, I], [I, 0]] / 2`` has the nonzero eigenvalues of ``R J R^T`` for any ``G = XX^T = R^T R``
    (``2d x 2d``). ``||M - P(M)||^2 = ||skew(M)||^2 + sum(relu(eig(sym(M)))^2)``.
    """
    return _c_qk_gauge_grams(_gram(wq, wq), _gram(wk, wk), _gram(wq, wk))


def _c_qk_gauge_grams(qq: torch.Tensor, kk: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
    """``C_QK_gauge`` from the float64 Gram blocks ``W_Q W_Q^T``, ``W_K W_K^T``, ``W_Q W_K^T``."""
    ok = _finite_heads(qq, kk, qk)
    qq, kk, qk = (torch.where(ok[:, None, None], g, 0) for g in (qq, kk, qk))
    n, d = qq.shape[0], qq.shape[-1]
    norm_sq = _inner(qq, kk).clamp(min=0)
    skew_sq = ((norm_sq - _inner(qk, qk.mT)) / 2).clamp(min=0)
    gram = torch.cat([torch.cat([qq, qk], -1), torch.cat([qk.mT, kk], -1)], -2)
    # A shift of ~1e-13 of the Gram's scale keeps the Cholesky factor defined for rank-deficient
    # heads; it moves the eigenvalues of R J R^T by about the same, far below float32 resolution.
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1)
    shift = 1e-13 * scale + torch.finfo(torch.float64).tiny
    eye = torch.eye(2 * d, dtype=gram.dtype, device=gram.device)
    r = torch.linalg.cholesky_ex(gram + shift[:, None, None] * eye).L.mT  # gram = r^T r
    r_q, r_k = r[..., :d], r[..., d:]
    m = r_q @ r_k.mT
    sym = (m + m.mT) / 2
    positive_sq = _positive_sq(sym) if n else norm_sq.new_zeros(0)
    out = _ratio(torch.sqrt(skew_sq + positive_sq), torch.sqrt(norm_sq))
    return torch.where(ok, out, torch.nan).float()


# -- per layer ----------------------------------------------------------------------------


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32)


def _f64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "mps":  # no float64 on Apple GPUs: the Gram blocks go to the CPU
        t = t.cpu()
    return t.to(torch.float64)


def _per_head_gram(rows: torch.Tensor) -> torch.Tensor:
    """``rows @ rows^T`` per head for ``[n, d, D]`` (float64 in, float64 out)."""
    return rows @ rows.mT


def _matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32. Half-precision CUDA weights multiply in their own dtype with float32
    accumulation and output: their products are exact in float32, and tensor cores run ~10x faster."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch build without mm(out_dtype=): same result, slower
            pass
    return _f32(a) @ _f32(b)


def _mlp_measure(weights: Sequence[torch.Tensor]) -> float | None:
    """``C`` of the product of the MLP's linear path (``[out, in]`` weights, input side first)."""
    if not weights:
        return None
    w = weights[0].detach()
    for nxt in weights[1:]:
        w = _matmul_f32(nxt.detach().to(w.device), w)
    w = _f32(w)
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
    # Query heads grouped by the KV head serving them: [KV, group, d, D]; KV slices [KV, d, D].
    if "C_Q" in keys:
        wq, wk = _f32(proj.q).reshape(kv, group, d, dim), _f32(proj.k).reshape(kv, 1, d, dim)
        out["C_Q"] = c_q(wq, wk).flatten().tolist()
    if "C_QK_gauge" in keys:
        wq, wk = _f64(proj.q).reshape(kv, group * d, dim), _f64(proj.k).reshape(kv, d, dim)
        qq = _per_head_gram(wq.reshape(heads, d, dim))
        kk = _per_head_gram(wk).repeat_interleave(group, 0)
        qk = (wq @ wk.mT).reshape(heads, d, d)  # [KV, group*d, d] -> W_Q^h W_K^(h's KV)^T
        out["C_QK_gauge"] = _c_qk_gauge_grams(qq, kk, qk).tolist()
    if "C_V" in keys:
        wv = _f64(proj.v).reshape(kv, d, dim)
        wo_t = _f64(proj.o).T.reshape(kv, group * d, dim)  # rows of W_O^T, i.e. W_O^h^T per head
        oo = _per_head_gram(wo_t.reshape(heads, d, dim))
        vv = _per_head_gram(wv).repeat_interleave(group, 0)
        vo = (wv @ wo_t.mT).reshape(kv, d, group, d).transpose(1, 2).reshape(heads, d, d)  # W_V W_O^h
        out["C_V"] = _c_product_grams(oo, vv, vo).tolist()
    if "C_V_layer" in keys:
        v = proj.v
        out["C_V_layer"] = float(c_square(_f32(v))) if v.shape[0] == v.shape[1] else None
    return out


@torch.no_grad()
def expert_measures(model: nn.Module) -> list[list[float]]:
    """``C_FF`` of every routed expert's ``W_down W_up``: a list per layer (``[]`` for a dense layer).

    All experts of a layer at once through :func:`c_product` (float64 ``I x I`` Gram blocks; the
    ``d_model x d_model`` product is never formed).
    """
    adapter = get_adapter(model)
    out = []
    for layer in range(adapter.num_layers):
        if not adapter.num_experts(layer):
            out.append([])
            continue
        _, up, down = adapter.expert_weights(layer)  # [E, I, H], [E, H, I] (GPT-OSS: de-interleaved views)
        out.append(c_product(down, up).tolist())
    return out


# -- public API ---------------------------------------------------------------------------


@torch.no_grad()
def head_measures(model: nn.Module, keys: Iterable[str] | None = None) -> dict:
    """S-invariant measures of every head and layer of ``model``, as a JSON-serialisable dict.

    Keys (each a list over layers; see the module docstring for the forms):
    ``"C_Q"``, ``"C_V"``, ``"C_QK_gauge"``: per layer a list per query head (empty for a
    layer without heads); ``"C_V_layer"``: per layer a float or ``None`` (``W_V`` not square);
    ``"C_FF"``: per layer a float; ``"meta"``: the form of each number and the layer head counts.
    A model with experts adds ``"C_FF_experts"`` (per layer a list per expert, empty for a dense
    layer; :func:`expert_measures`) and ``meta["num_experts"]``; a dense model's result has neither
    unless ``keys`` names it. Computed in float32 on each layer's own device, whatever the model's dtype; heads are
    numbered as the (possibly pruned) layers have them now. ``keys`` limits the computation
    to a subset of the measures (``"meta"`` is always present).
    """
    adapter = get_adapter(model)
    experts = [adapter.num_experts(i) for i in range(adapter.num_layers)]
    wanted = ALL_KEYS + (EXPERT_KEYS if any(experts) else ()) if keys is None else tuple(keys)
    unknown = set(wanted) - set(ALL_KEYS + EXPERT_KEYS)
    if unknown:
        raise ValueError(f"unknown measures {sorted(unknown)}; choose from {list(ALL_KEYS + EXPERT_KEYS)}")
    result: dict = {k: [] for k in ALL_KEYS if k in wanted}
    layouts = [adapter.layout(i) for i in range(adapter.num_layers)]
    for layer in range(adapter.num_layers):
        values = layer_measures(adapter, layer, wanted)
        for k in result:
            result[k].append(values[k])
    if "C_FF_experts" in wanted:
        result["C_FF_experts"] = expert_measures(model)
    result["meta"] = {
        "forms": {k: v for k, v in FORMS.items() if k in result or k not in ALL_KEYS + EXPERT_KEYS},
        "num_heads": [lay.num_heads for lay in layouts],
        "num_kv_heads": [lay.num_kv_heads for lay in layouts],
        "head_dim": [lay.head_dim for lay in layouts],
    }
    if "C_FF_experts" in result:
        result["meta"]["num_experts"] = experts
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
