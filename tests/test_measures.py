"""S-invariant measures: against naive full-size float64 formulas, invariances, extremes, dtypes."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from sinv_prune import get_adapter, head_measures, prune_heads
from sinv_prune.scoring import measures
from sinv_prune.scoring.measures import ALL_KEYS, c_product, c_qk_gauge, measure_summary

ATOL = 2e-5


# -- naive reference: full d_model x d_model matrices, float64, one head at a time ---------


def naive_c(w: torch.Tensor) -> float:
    n = torch.linalg.matrix_norm(w)
    return 0.0 if n == 0 else float(torch.linalg.matrix_norm(w + w.T) / (2 * n))


def naive_gauge(wq: torch.Tensor, wk: torch.Tensor) -> float:
    m = wq.T @ wk
    sym = (m + m.T) / 2
    evals, evecs = torch.linalg.eigh(sym)
    projection = evecs @ torch.diag(evals.clamp(max=0)) @ evecs.T
    n = torch.linalg.matrix_norm(m)
    return 0.0 if n == 0 else float(torch.linalg.matrix_norm(m - projection) / n)


def naive_measures(model) -> dict:
    adapter = get_adapter(model)
    out = {k: [] for k in ALL_KEYS}
    for layer in range(adapter.num_layers):
        lay = adapter.layout(layer)
        h_, d = lay.num_heads, lay.head_dim
        up, down = (w.detach().double() for w in adapter.mlp(layer))
        out["C_FF"].append(naive_c(down @ up))
        cq, cv, cg = [], [], []
        if h_:
            p = adapter.projections(layer)
            q, k, v, o = (t.detach().double() for t in (p.q, p.k, p.v, p.o))
            for h in range(h_):
                j = h // lay.group_size
                wq, wk, wv = q[h * d : (h + 1) * d], k[j * d : (j + 1) * d], v[j * d : (j + 1) * d]
                wo = o[:, h * d : (h + 1) * d]
                cq.append(float(torch.linalg.matrix_norm(wq + wk) / (wq.norm() + wk.norm())))
                cv.append(naive_c(wo @ wv))
                cg.append(naive_gauge(wq, wk))
            out["C_V_layer"].append(naive_c(v) if v.shape[0] == v.shape[1] else None)
        else:
            out["C_V_layer"].append(None)
        out["C_Q"].append(cq)
        out["C_V"].append(cv)
        out["C_QK_gauge"].append(cg)
    return out


def assert_close(got: dict, want: dict, atol: float = ATOL, keys=ALL_KEYS) -> None:
    for key in keys:
        assert len(got[key]) == len(want[key]), key
        for layer, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            if w is None or g is None:
                assert g is None and w is None, (key, layer, g, w)
            elif isinstance(w, list):
                assert len(g) == len(w), (key, layer)
                diff = max((abs(a - b) for a, b in zip(g, w, strict=True)), default=0.0)
                assert diff <= atol, (key, layer, diff)
            else:
                assert abs(g - w) <= atol, (key, layer, g, w)


def prune_plan(model) -> dict:
    """A GQA-valid removal for every tiny arch: a whole KV group in layer 0, one head per group
    in layer 1 (two heads without GQA), every head of layer 2."""
    lay = get_adapter(model).layout(0)
    g = lay.group_size
    layer1 = list(range(0, lay.num_heads, g)) if g > 1 else [1, 3]
    return {0: list(range(g)), 1: layer1, 2: list(range(lay.num_heads))}


def group_rows(lay, kv_head: int) -> tuple[list[slice], slice]:
    """Row slices of the query heads served by ``kv_head``, and of the KV head itself."""
    d, g = lay.head_dim, lay.group_size
    queries = [slice(h * d, (h + 1) * d) for h in range(kv_head * g, (kv_head + 1) * g)]
    return queries, slice(kv_head * d, (kv_head + 1) * d)


# -- tests --------------------------------------------------------------------------------


def test_matches_naive(arch):
    model = tiny_model(arch)
    got = head_measures(model)
    assert_close(got, naive_measures(model))
    square = arch in ("gpt2", "bert", "roberta")
    assert all((v is not None) == square for v in got["C_V_layer"])
    assert got["meta"]["num_heads"] == [get_adapter(model).layout(i).num_heads for i in range(3)]


def test_matches_naive_after_pruning(arch):
    model = tiny_model(arch, seed=1)
    prune_heads(model, prune_plan(model), allow_empty_layers=True)
    got = head_measures(model)
    layouts = [get_adapter(model).layout(i) for i in range(3)]
    assert [len(x) for x in got["C_Q"]] == [lay.num_heads for lay in layouts]
    assert got["C_Q"][2] == got["C_V"][2] == got["C_QK_gauge"][2] == []
    assert got["C_V_layer"] == [None, None, None]  # W_V is no longer square anywhere
    assert got["meta"]["num_heads"] == [lay.num_heads for lay in layouts]
    assert_close(got, naive_measures(model))
    json.dumps(got, allow_nan=False)
    summary = measure_summary(got)
    assert summary["C_Q"]["layers"][2] == {"mean": None, "min": None, "max": None, "n": 0}
    assert summary["C_Q"]["all"]["n"] == sum(lay.num_heads for lay in layouts)


def test_values_in_unit_interval_and_json(arch):
    got = head_measures(tiny_model(arch, seed=2))
    assert json.loads(json.dumps(got, allow_nan=False)) == got
    for key in ALL_KEYS:
        flat = [v for x in got[key] for v in (x if isinstance(x, list) else [x]) if v is not None]
        assert flat or key == "C_V_layer", key  # C_V_layer is None throughout under GQA
        assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in flat), key


def test_keys_subset():
    model = tiny_model("llama")
    got = head_measures(model, keys=["C_Q"])
    assert set(got) == {"C_Q", "meta"}
    assert got["C_Q"] == head_measures(model)["C_Q"]
    with pytest.raises(ValueError, match="unknown measures"):
        head_measures(model, keys=["C_X"])


@pytest.mark.parametrize("arch_name", ["gpt2", "llama"])
def test_gauge(arch_name):
    """C_Q: invariant under a shared orthogonal A only; C_QK_gauge: under any invertible A."""
    model = tiny_model(arch_name)
    adapter = get_adapter(model)
    lay = adapter.layout(1)
    q_rows, kv_rows = group_rows(lay, kv_head=1)
    heads = range(lay.group_size, 2 * lay.group_size)
    before = head_measures(model)
    g = torch.Generator().manual_seed(0)
    ortho, _ = torch.linalg.qr(torch.randn(lay.head_dim, lay.head_dim, generator=g, dtype=torch.float64))
    scale = torch.diag(torch.linspace(0.4, 2.5, lay.head_dim, dtype=torch.float64))

    for a, c_q_kept in ((ortho, True), (ortho @ scale @ ortho.T @ ortho.T, False)):
        m = copy.deepcopy(model)
        p = get_adapter(m).projections(1)
        with torch.no_grad():
            for rows in q_rows:
                p.q[rows] = (a @ p.q[rows].double()).float()
            p.k[kv_rows] = (torch.linalg.inv(a).T @ p.k[kv_rows].double()).float()
        after = head_measures(m)
        for layer in (0, 2):
            assert after["C_Q"][layer] == before["C_Q"][layer]
        for h in heads:
            assert math.isclose(after["C_QK_gauge"][1][h], before["C_QK_gauge"][1][h], abs_tol=1e-5)
            moved = abs(after["C_Q"][1][h] - before["C_Q"][1][h])
            assert moved < 1e-5 if c_q_kept else moved > 1e-3
        assert after["C_V"] == before["C_V"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype):
    model = tiny_model("llama")
    half = copy.deepcopy(model).to(dtype)
    rounded = copy.deepcopy(half).to(torch.float32)
    got = head_measures(half)
    assert next(half.parameters()).dtype == dtype  # the model itself is not cast
    assert_close(got, head_measures(rounded), atol=1e-5)


def test_half_precision_gpt2_conv1d():
    model = tiny_model("gpt2").to(torch.bfloat16)
    assert_close(head_measures(model), head_measures(copy.deepcopy(model).float()), atol=1e-5)


@pytest.mark.parametrize("arch_name", ["bert", "mistral"])
def test_attractor_and_extremes(arch_name):
    """W_Q = -W_K: C_Q = C_QK_gauge = 0; W_Q = W_K: both 1. Antisymmetric OV: C_V = 0; symmetric: 1."""
    model = tiny_model(arch_name)
    adapter = get_adapter(model)
    lay = adapter.layout(0)
    d = lay.head_dim
    g = torch.Generator().manual_seed(3)
    skew = torch.randn(d, d, generator=g)
    skew = skew - skew.T
    with torch.no_grad():
        for layer, sign in ((0, -1.0), (1, 1.0)):
            p = adapter.projections(layer)
            for kv in range(lay.num_kv_heads):
                q_rows, kv_rows = group_rows(lay, kv)
                for rows in q_rows:
                    p.q[rows] = sign * p.k[kv_rows]
                    # OV circuit W_V^T J W_V: antisymmetric for J = skew, symmetric for J = skew @ skew.
                    j = skew if sign < 0 else skew @ skew
                    p.o[:, rows] = p.v[kv_rows].T @ j
    got = head_measures(model)
    assert got["C_Q"][0] == [0.0] * lay.num_heads
    assert max(got["C_QK_gauge"][0]) < 1e-5
    assert max(got["C_V"][0]) < 1e-5
    assert min(got["C_Q"][1]) > 1 - 1e-5
    assert min(got["C_QK_gauge"][1]) > 1 - 1e-5
    assert min(got["C_V"][1]) > 1 - 1e-5
    assert_close(got, naive_measures(model))


def test_zero_weights_give_zero():
    model = tiny_model("gpt2")
    adapter = get_adapter(model)
    with torch.no_grad():
        p = adapter.projections(0)
        d = adapter.layout(0).head_dim
        for t in (p.q, p.k, p.v):
            t[:d] = 0
    got = head_measures(model)
    assert got["C_Q"][0][0] == got["C_V"][0][0] == got["C_QK_gauge"][0][0] == 0.0
    assert got["C_Q"][0][1] > 0


@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(1, 6),
    dim=st.integers(1, 10),
    n=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    rank=st.integers(0, 6),
)
def test_kernels_any_shape(d, dim, n, seed, rank):
    """Subspace kernels equal the full-size formulas, including 2*d_head > d_model and low rank."""
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(n, d, dim, generator=g)
    wk = torch.randn(n, d, dim, generator=g)
    wo = torch.randn(n, dim, d, generator=g)
    if rank < d:  # rank-deficient slices
        wq[:, rank:] = 0
        wo[:, :, rank:] = 0
    got_g, got_v = c_qk_gauge(wq, wk), c_product(wo, wq)
    for i in range(n):
        q, k, o = wq[i].double(), wk[i].double(), wo[i].double()
        assert math.isclose(float(got_g[i]), naive_gauge(q, k), abs_tol=1e-5)
        assert math.isclose(float(got_v[i]), naive_c(o @ q), abs_tol=1e-5)


def test_non_finite_weights_give_nan():
    model = tiny_model("gpt2")
    adapter = get_adapter(model)
    with torch.no_grad():
        adapter.projections(0).q[0, 0] = float("nan")
        adapter.projections(1).v[0, 0] = float("inf")
    got = head_measures(model)
    assert math.isnan(got["C_Q"][0][0]) and math.isnan(got["C_QK_gauge"][0][0])
    assert math.isnan(got["C_V"][1][0]) and math.isnan(got["C_V_layer"][1])
    assert not any(math.isnan(v) for v in got["C_Q"][0][1:] + got["C_V"][1][1:] + got["C_V"][0])


# -- batched kernels: accuracy, accelerator path, half precision -------------------------


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "gpt2"])
def test_bf16_gqa_matches_naive(arch_name):
    """bf16 weights (GQA groups of 3 and 2 for llama / qwen2): float32 results equal the float64
    formulas on the same bf16 values."""
    model = tiny_model(arch_name, seed=4).to(torch.bfloat16)
    assert_close(head_measures(model), naive_measures(model))


def test_near_attractor_accuracy():
    """Values of order 1e-6..1e-4 come out to 1e-7 (a float32 trace identity would be off by ~2e-4)."""
    model = tiny_model("llama", seed=5)
    adapter = get_adapter(model)
    lay = adapter.layout(0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        p = adapter.projections(0)
        for kv in range(lay.num_kv_heads):
            q_rows, kv_rows = group_rows(lay, kv)
            skew = torch.randn(lay.head_dim, lay.head_dim, generator=g)
            skew = skew - skew.T + 1e-6 * torch.randn(lay.head_dim, lay.head_dim, generator=g)
            for rows in q_rows:
                p.q[rows] = -p.k[kv_rows] + 1e-6 * torch.randn(p.k[kv_rows].shape, generator=g)
                p.o[:, rows] = p.v[kv_rows].T @ skew
    got, want = head_measures(model), naive_measures(model)
    assert 1e-7 < max(want["C_QK_gauge"][0]) < 1e-3 and 1e-7 < max(want["C_V"][0]) < 1e-3
    assert_close(got, want, atol=1e-7, keys=["C_Q", "C_V", "C_QK_gauge"])


def test_newton_schulz_positive_part_matches_eigvalsh():
    g = torch.Generator().manual_seed(6)
    a = torch.randn(6, 24, 24, generator=g, dtype=torch.float64)
    sym = a + a.mT
    sym[0] = 0
    sym[1] = -(a[1] @ a[1].mT)  # negative semi-definite: 0
    sym[2] = 1e-3 * a[2] @ a[2].mT  # positive semi-definite
    sym[3, :12, :12] = 0  # rank-deficient
    got = measures._positive_sq_newton_schulz(sym)
    want = measures._positive_sq_eigvalsh(sym)
    assert got[0] == 0
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(sym.square().sum()))


def test_accelerator_path_on_cpu(monkeypatch, arch):
    """The Newton-Schulz positive part (used off the CPU) gives the same measures."""
    model = tiny_model(arch, seed=7)
    monkeypatch.setattr(measures, "_positive_sq", measures._positive_sq_newton_schulz)
    assert_close(head_measures(model), naive_measures(model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matches_naive():
    model = tiny_model("llama", seed=8).to(torch.bfloat16)
    want = naive_measures(model)
    assert_close(head_measures(model.cuda()), want)
