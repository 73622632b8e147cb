"""Selection: every constraint, property-based over random scores and tiny GQA layouts, plus worked examples."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sinv_prune import get_adapter, prune_heads
from sinv_prune.arch import HeadLayout
from sinv_prune.units.heads import plan_removal
from sinv_prune.units.heads.selection import model_layouts, select_heads

# -- an independent oracle: brute force over every subset of heads ------------------------


def valid_kept(layout: HeadLayout, kept: frozenset, min_heads: int, shape: str = "auto") -> bool:
    """The GQA rule of prune_heads, written out: kept groups all keep the same count; plus the layout's rule."""
    if len(kept) == layout.num_heads:
        return True  # untouched
    if len(kept) < min_heads:
        return False
    sizes = [sum(1 for h in kept if h // layout.group_size == k) for k in range(layout.num_kv_heads)]
    if layout.group_size > 1 and shape == "q_per_group" and 0 in sizes:
        return False  # every KV group stays
    if layout.group_size > 1 and shape == "kv_groups" and any(0 < n < layout.group_size for n in sizes):
        return False  # groups go whole or not at all
    return len({s for s in sizes if s}) <= 1


def layer_outcomes(layout: HeadLayout, min_heads: int, shape: str) -> set[tuple[int, int]]:
    """Every reachable (kept heads, kept KV heads) of one layer."""
    out = set()
    for n in range(layout.num_heads + 1):
        for kept in itertools.combinations(range(layout.num_heads), n):
            if valid_kept(layout, frozenset(kept), min_heads, shape):
                g = layout.group_size
                out.add((n, len({h // g for h in kept})))
    return out


def expected_count(layouts, wanted: int, mode: str, min_heads: int, shape: str) -> int | None:
    """Heads the selection must remove, or None where it must raise."""
    outcomes = [layer_outcomes(lay, min_heads, shape) for lay in layouts]
    if mode == "uniform":
        common = set.intersection(*outcomes)
        totals = {sum(lay.num_heads for lay in layouts) - len(layouts) * k for k, _ in common}
    else:
        totals = {0}
        for lay, outs in zip(layouts, outcomes, strict=True):
            totals = {t + lay.num_heads - k for t in totals for k, _ in outs}
    if wanted == 0:
        return 0
    if not totals or max(totals) < wanted:
        return None
    best = max((t for t in totals if t <= wanted), default=0)
    return best or None


def stub_adapter(layouts):
    return SimpleNamespace(num_layers=len(layouts), layout=lambda layer: layouts[layer])


# -- strategies ---------------------------------------------------------------------------


@st.composite
def problems(draw):
    layers = draw(st.integers(1, 4))
    gqa = draw(st.booleans())
    layouts = []
    for _ in range(layers):
        groups = draw(st.integers(1, 3))
        size = draw(st.integers(1, 3)) if gqa else 1
        if not gqa:
            groups = draw(st.integers(1, 5))
        layouts.append(HeadLayout(groups * size, groups, 8))
    if draw(st.booleans()):  # all layers alike, as in a fresh model
        layouts = [layouts[0]] * layers
    value = st.sampled_from([0.0, 0.5, 1.0]) if draw(st.booleans()) else st.floats(-10, 10, allow_nan=False)
    scores = [draw(st.lists(value, min_size=lay.num_heads, max_size=lay.num_heads)) for lay in layouts]
    total = sum(lay.num_heads for lay in layouts)
    amount = draw(st.integers(0, total) | st.floats(0, 1))
    return dict(
        scores=scores,
        amount=amount,
        layouts=layouts,
        mode=draw(st.sampled_from(["global", "per_layer", "uniform"])),
        layout=draw(st.sampled_from(["q_per_group", "kv_groups", "auto"])),
        min_heads_per_layer=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 3)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_selection_honours_every_constraint(problem):
    layouts, scores, min_heads = problem["layouts"], problem["scores"], problem["min_heads_per_layer"]
    total = sum(lay.num_heads for lay in layouts)
    amount = problem["amount"]
    wanted = math.floor(amount * total + 0.5) if isinstance(amount, float) else amount
    expected = expected_count(layouts, wanted, problem["mode"], min_heads, problem["layout"])
    if expected is None:
        with pytest.raises(ValueError):
            select_heads(**problem)
        return
    result = select_heads(**problem)
    assert result == select_heads(**problem), "deterministic"
    assert sum(len(h) for h in result.values()) == expected

    # Valid for prune_heads, GQA groups equal, minimum heads kept.
    plan = plan_removal(stub_adapter(layouts), result, allow_empty_layers=min_heads == 0)
    assert set(plan) == set(result)
    kept = {}
    for layer, lay in enumerate(layouts):
        removed = set(result.get(layer, []))
        heads = frozenset(h for h in range(lay.num_heads) if h not in removed)
        assert valid_kept(lay, heads, min_heads, problem["layout"])
        kept[layer] = (len(heads), len({h // lay.group_size for h in heads}))
        # Inside a KV group that keeps heads, no removed head outscores a kept one.
        for k in range(lay.num_kv_heads):
            members = range(k * lay.group_size, (k + 1) * lay.group_size)
            gone = [scores[layer][h] for h in members if h in removed]
            stay = [scores[layer][h] for h in members if h in heads]
            if gone and stay:
                assert max(gone) <= min(stay)
    if problem["mode"] == "uniform" and result:
        assert len(set(kept.values())) == 1, "uniform: every layer ends alike"

    # Without GQA, global mode removes the lowest scores wherever a layer may still lose one.
    if problem["mode"] == "global" and all(lay.group_size == 1 for lay in layouts):
        gone = [scores[layer][h] for layer, heads in result.items() for h in heads]
        open_layers = [layer for layer in range(len(layouts)) if kept[layer][0] > max(min_heads, 0)]
        stay = [scores[layer][h] for layer in open_layers for h in range(layouts[layer].num_heads)
                if h not in result.get(layer, [])]  # fmt: skip
        if gone and stay:
            assert max(gone) <= min(stay)


# -- worked examples ----------------------------------------------------------------------

GQA = HeadLayout(6, 2, 8)  # 2 KV groups of 3 query heads


def test_global_takes_lowest_scores():
    layouts = [HeadLayout(4, 4, 8)] * 3
    scores = [[0.9, 0.1, 0.8, 0.7], [0.2, 0.95, 0.3, 0.85], [0.6, 0.5, 0.4, 0.99]]
    assert select_heads(scores, 3, layouts=layouts) == {0: [1], 1: [0, 2]}
    assert select_heads(scores, 0.25, layouts=layouts) == {0: [1], 1: [0, 2]}  # 0.25 * 12 = 3


def test_per_layer_spreads_removals():
    layouts = [HeadLayout(4, 4, 8)] * 3
    scores = [[0.9, 0.1, 0.8, 0.7], [0.2, 0.95, 0.3, 0.85], [0.6, 0.5, 0.4, 0.99]]
    result = select_heads(scores, 3, layouts=layouts, mode="per_layer")
    assert result == {0: [1], 1: [0], 2: [2]}
    assert select_heads(scores, 6, layouts=layouts, mode="uniform") == {0: [1, 3], 1: [0, 2], 2: [1, 2]}


def test_gqa_trims_each_group_or_drops_one():
    scores = [[0.1, 0.9, 0.8, 0.2, 0.7, 0.6]]
    auto = {"layouts": [GQA], "layout": "auto"}
    assert select_heads(scores, 2, **auto) == {0: [0, 3]}  # weakest head of each group
    assert select_heads(scores, 3, **auto) == {0: [3, 4, 5]}  # drop the weaker group
    # 4: keeping one group's best two (ranks 5, 4) beats each group's best one (ranks 5, 3).
    assert select_heads(scores, 4, **auto) == {0: [0, 3, 4, 5]}
    with pytest.raises(ValueError, match="cannot remove exactly 1"):
        select_heads(scores, 1, **auto)  # 5 heads cannot split into equal groups
    with pytest.raises(ValueError, match="cannot remove exactly 3"):
        select_heads([[0.1] * 6] * 2, 3, layouts=[GQA, GQA], mode="uniform", layout="auto")


def test_nearest_not_exceeding_and_exact():
    scores = [[0.1, 0.9, 0.8, 0.2, 0.7, 0.6]] * 2
    # 2 groups of 4 keep 8, 6, 4, 3, 2 or 1 heads: removing 3 is impossible, 2 is the nearest below.
    wide = [HeadLayout(8, 2, 8)]
    auto = {"layout": "auto"}
    assert select_heads([[0.1, 0.9, 0.8, 0.5, 0.2, 0.7, 0.6, 0.4]], 3, layouts=wide, **auto) == {0: [0, 4]}
    with pytest.raises(ValueError, match="nearest achievable below is 2"):
        select_heads([[0.5] * 8], 3, layouts=wide, exact=True, **auto)
    assert sum(map(len, select_heads(scores, 9, layouts=[GQA, GQA], mode="uniform", **auto).values())) == 8
    with pytest.raises(ValueError, match="nearest achievable below is 8"):
        select_heads(scores, 9, layouts=[GQA, GQA], mode="uniform", exact=True, **auto)


# -- layouts: which GQA cuts are allowed ----------------------------------------------------

SMOL = HeadLayout(9, 3, 64)  # SmolLM2: 3 KV groups of 3 query heads


def group_alike_scores(layers: int) -> list[list[float]]:
    """Scores where a group's heads score alike (as magnitude's do): layer l's group l % 3 is the weakest."""
    rows = []
    for layer in range(layers):
        weak = layer % 3
        rows.append([(0.1 if h // 3 == weak else 0.5 + 0.1 * (h // 3)) + 0.01 * (h % 3) for h in range(9)])
    return rows


def test_uniform_default_removes_one_query_head_per_group():
    scores = group_alike_scores(4)
    layouts = [SMOL] * 4
    default = select_heads(scores, 12, layouts=layouts, mode="uniform")
    assert default == {layer: [0, 3, 6] for layer in range(4)}  # each group's weakest head; every KV group stays
    assert default == select_heads(scores, 12, layouts=layouts, mode="uniform", layout="q_per_group")
    whole = {layer: [3 * (layer % 3), 3 * (layer % 3) + 1, 3 * (layer % 3) + 2] for layer in range(4)}
    assert select_heads(scores, 12, layouts=layouts, mode="uniform", layout="kv_groups") == whole
    assert select_heads(scores, 12, layouts=layouts, mode="uniform", layout="auto") == whole  # the cheapest cut


@pytest.mark.parametrize("mode", ["global", "per_layer"])
def test_layout_constrains_global_and_per_layer(mode):
    scores = group_alike_scores(4)
    layouts = [SMOL] * 4
    for layout, whole_groups in (("q_per_group", False), ("kv_groups", True)):
        result = select_heads(scores, 12, layouts=layouts, mode=mode, layout=layout)
        assert sum(map(len, result.values())) == 12
        for heads in result.values():
            per_group = [sum(1 for h in heads if h // 3 == k) for k in range(3)]
            assert all(n in (0, 3) for n in per_group) if whole_groups else max(per_group) < 3


def test_layouts_are_one_thing_without_gqa():
    layouts = [HeadLayout(4, 4, 8)] * 3
    scores = [[0.9, 0.1, 0.8, 0.7], [0.2, 0.95, 0.3, 0.85], [0.6, 0.5, 0.4, 0.99]]
    for mode in ("global", "per_layer", "uniform"):
        for min_heads in (0, 1):
            results = [select_heads(scores, 6, layouts=layouts, mode=mode, layout=layout, min_heads_per_layer=min_heads)
                       for layout in ("q_per_group", "kv_groups", "auto")]  # fmt: skip
            assert results[0] == results[1] == results[2] and results[0]


def test_layout_errors_name_the_layout():
    layouts = [SMOL] * 2
    scores = group_alike_scores(2)
    with pytest.raises(ValueError, match="cannot remove exactly 4 heads in mode 'uniform' with layout 'q_per_group'"):
        select_heads(scores, 4, layouts=layouts, mode="uniform", exact=True)
    # Every KV group stays, so even min_heads_per_layer=0 leaves 3 heads a layer.
    with pytest.raises(ValueError, match="larger than the 12 heads that may be removed with layout 'q_per_group'"):
        select_heads(scores, 14, layouts=layouts, min_heads_per_layer=0)
    assert sum(map(len, select_heads(scores, 14, layouts=layouts, min_heads_per_layer=0, layout="auto").values())) == 14
    with pytest.raises(ValueError, match="uniform: amount 14 .* with layout 'kv_groups'"):
        select_heads(scores, 14, layouts=layouts, mode="uniform", layout="kv_groups")
    with pytest.raises(ValueError, match="unknown selection layout 'groups'; choose one of q_per_group, kv_groups"):
        select_heads(scores, 3, layouts=layouts, layout="groups")


def test_min_heads_and_amount_errors():
    layouts = [HeadLayout(4, 4, 8)] * 2
    scores = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]
    assert select_heads(scores, 4, layouts=layouts, min_heads_per_layer=2) == {0: [0, 1], 1: [0, 1]}
    assert select_heads(scores, 8, layouts=layouts, min_heads_per_layer=0) == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    with pytest.raises(ValueError, match="larger than the 6 heads that may be removed"):
        select_heads(scores, 7, layouts=layouts)
    with pytest.raises(ValueError, match="larger than the 8 heads"):
        select_heads(scores, 9, layouts=layouts)
    with pytest.raises(ValueError, match="fraction in"):
        select_heads(scores, 1.5, layouts=layouts)
    with pytest.raises(ValueError, match="non-negative integer"):
        select_heads(scores, True, layouts=layouts)
    with pytest.raises(ValueError, match="NaN"):
        select_heads([[math.nan] * 4, [0.0] * 4], 1, layouts=layouts)
    with pytest.raises(ValueError, match="3 scores for 4 heads"):
        select_heads([[0.0] * 3, [0.0] * 4], 1, layouts=layouts)
    with pytest.raises(ValueError, match="unknown selection mode"):
        select_heads(scores, 1, layouts=layouts, mode="local")
    assert select_heads(scores, 0, layouts=layouts) == {}


def test_ties_follow_the_seed():
    layouts = [HeadLayout(8, 8, 8)] * 2
    scores = [[0.5] * 8] * 2
    picks = {tuple(sorted((k, tuple(v)) for k, v in select_heads(scores, 5, layouts=layouts, seed=s).items()))
             for s in range(6)}  # fmt: skip
    assert len(picks) > 1
    assert select_heads(scores, 5, layouts=layouts, seed=2) == select_heads(scores, 5, layouts=layouts, seed=2)


def test_only_the_order_of_scores_matters():
    layouts = [GQA] * 3
    scores = [[0.1, 0.9, 0.8, 0.2, 0.7, 0.6], [0.3, 0.35, 0.5, 0.05, 0.95, 0.4], [0.0, 0.15, 0.25, 0.45, 0.55, 0.65]]
    squashed = [[math.exp(10 * x) - 3 for x in row] for row in scores]
    for mode in ("global", "per_layer", "uniform"):
        assert select_heads(scores, 6, layouts=layouts, mode=mode) == select_heads(
            squashed, 6, layouts=layouts, mode=mode
        )


@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("mode", ["global", "per_layer", "uniform"])
def test_real_models_accept_the_selection(which, mode):
    model = tiny_model(which)
    adapter = get_adapter(model)
    heads = sum(lay.num_heads for lay in model_layouts(model))
    scores = [[((7 * layer + 3 * h) % 11) / 11 for h in range(lay.num_heads)]
              for layer, lay in enumerate(model_layouts(model))]  # fmt: skip
    result = select_heads(scores, heads // 2, layouts=model, mode=mode)
    plan_removal(adapter, result)
    prune_heads(model, result)
    if mode == "uniform":
        assert len(set(model_layouts(model))) == 1
