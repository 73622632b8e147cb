"""select_channels and select_layers: amounts, constraints, ties and errors."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
from conftest import tiny_model

from sinv_prune import select_channels, select_layers
from sinv_prune.units.mlp.selection import standardize


def random_scores(sizes: list[int], seed: int = 0) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.random() for _ in range(n)] for n in sizes]


def kept_counts(sizes: list[int], removed: dict[int, list[int]]) -> list[int]:
    return [n - len(removed.get(layer, [])) for layer, n in enumerate(sizes)]


def test_global_removes_the_lowest_standardised_scores_skipping_layers_at_their_minimum():
    """Global ranks (s - mean) / std within each layer (issue 17): layers 0 and 1 standardise alike
    (z = -1.46, -0.88, -0.29, ...), layer 2's two outliers to -1.41 and -1.39; raw scores would have
    taken layer 0's first two instead of one from each of layers 0 and 1."""
    sizes = [6, 6, 6]
    scores = [[0.0, 0.1, 0.2, 0.3, 0.4, 0.5], [5, 6, 7, 8, 9, 10], [0.05, 0.15, 11, 12, 13, 14]]
    assert select_channels(sizes, scores, 4) == {0: [0], 1: [0], 2: [0, 1]}
    assert select_channels(sizes, scores, 8, min_channels_per_layer=2) == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1]}


def test_per_layer_spreads_the_cut_over_layers_whatever_the_scale():
    sizes = [8, 8, 4]
    scores = [[100 + x for x in row] for row in random_scores(sizes[:2])] + [[0.1, 0.4, 0.3, 0.2]]
    removed = select_channels(sizes, scores, 0.5, mode="per_layer")
    assert kept_counts(sizes, removed) == [4, 4, 2]
    assert removed[2] == [0, 3]
    # global no longer takes the low-scale layer first (down to 1): its scores are standardised first
    assert select_channels(sizes, scores, 5) == {0: [3, 7], 1: [4, 7], 2: [0]}


def brute_force(sizes, ranks, wanted, min_keep, multiple):
    """Best (most removed <= wanted, then least rank sum) over every per-layer count, lowest ranks first."""
    choices = []
    for n in sizes:
        allowed = [0] + [n - k for k in range(multiple, n, multiple) if k >= min_keep]
        choices.append(allowed)
    best = None
    for combo in itertools.product(*choices):
        total = sum(combo)
        if total > wanted:
            continue
        cost = sum(sum(sorted(r)[:c]) for r, c in zip(ranks, combo, strict=True))
        key = (-total, cost)
        if best is None or key < best[0]:
            best = (key, combo)
    return best


@pytest.mark.parametrize(("multiple", "min_keep", "wanted"), [(2, 1, 9), (3, 2, 10), (4, 4, 13), (1, 3, 11)])
def test_multiple_keeps_multiples_at_the_least_cost(multiple, min_keep, wanted, caplog):
    sizes = [8, 10, 7]
    scores = random_scores(sizes, seed=multiple)
    z = [standardize(row) for row in scores]  # global mode ranks standardised scores
    flat = sorted((s, layer, c) for layer, row in enumerate(z) for c, s in enumerate(row))
    rank = {(layer, c): i for i, (_, layer, c) in enumerate(flat)}
    ranks = [[rank[layer, c] for c in range(n)] for layer, n in enumerate(sizes)]
    with caplog.at_level(logging.WARNING, logger="sinv_prune"):
        removed = select_channels(sizes, scores, wanted, multiple=multiple, min_channels_per_layer=min_keep)
    (neg_total, cost), combo = brute_force(sizes, ranks, wanted, min_keep, multiple)
    assert [len(removed.get(layer, [])) for layer in range(3)] == list(combo)
    assert sum(ranks[layer][c] for layer, cs in removed.items() for c in cs) == cost
    for layer, kept in enumerate(kept_counts(sizes, removed)):
        assert kept == sizes[layer] or (kept % multiple == 0 and kept >= min_keep)
    for layer, cs in removed.items():  # within a layer the lowest-scored go
        assert max(scores[layer][c] for c in cs) <= min(s for c, s in enumerate(scores[layer]) if c not in cs)
    assert ("requested" in caplog.text) == (-neg_total != wanted)


def test_uniform_leaves_every_layer_alike():
    sizes = [16, 16, 16]
    scores = random_scores(sizes)
    removed = select_channels(sizes, scores, 20, mode="uniform", multiple=4)
    assert kept_counts(sizes, removed) == [12, 12, 12]  # 24 would exceed 20
    assert kept_counts(sizes, select_channels(sizes, scores, 24, mode="uniform", multiple=4, exact=True)) == [8] * 3
    with pytest.raises(
        ValueError, match="cannot remove exactly 20 channels in mode 'uniform'.*nearest achievable below is 12"
    ):
        select_channels(sizes, scores, 20, mode="uniform", multiple=4, exact=True)
    with pytest.raises(ValueError, match="uniform: amount 46 is larger than the 45 channels"):
        select_channels(sizes, scores, 46, mode="uniform")


def test_ties_are_broken_by_the_seed():
    sizes = [8, 8]
    flat = [[1.0] * 8, [1.0] * 8]
    picks = {tuple(map(tuple, select_channels(sizes, flat, 5, seed=s).values())) for s in range(6)}
    assert len(picks) > 1
    assert select_channels(sizes, flat, 5, seed=3) == select_channels(sizes, flat, 5, seed=3)


def test_model_sizes_and_fraction():
    model = tiny_model("llama")  # 3 layers of 64 channels
    scores = random_scores([64] * 3)
    removed = select_channels(model, scores, 0.25, multiple=8)
    assert sum(map(len, removed.values())) == 48
    assert all(n % 8 == 0 for n in kept_counts([64] * 3, removed))


def test_shortfall_warns_or_raises(caplog):
    sizes = [8, 8]
    scores = random_scores(sizes)
    with caplog.at_level(logging.WARNING, logger="sinv_prune"):
        removed = select_channels(sizes, scores, 7, multiple=4)
    assert sum(map(len, removed.values())) == 4 and "7 channels requested, 4 removed" in caplog.text
    with pytest.raises(ValueError, match="cannot remove exactly 7 channels.*nearest achievable below is 4"):
        select_channels(sizes, scores, 7, multiple=4, exact=True)
    with pytest.raises(ValueError, match="cannot remove exactly 3 channels.*no smaller removal"):
        select_channels(sizes, scores, 3, multiple=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"amount": 17}, "amount 17 is larger than the 16 channels of the model"),
        ({"amount": 15}, "amount 15 is larger than the 12 channels that may be removed"),  # a quarter stays
        ({"amount": 15, "min_channels_per_layer": 1}, "larger than the 14 channels that may be removed"),
        ({"amount": 1.5}, r"a float amount is a fraction in \[0, 1\]"),
        ({"amount": -1}, "amount must be a non-negative integer"),
        ({"amount": 2, "mode": "local"}, "unknown selection mode 'local'"),
        ({"amount": 2, "min_channels_per_layer": 0}, "min_channels_per_layer must be at least 1"),
        ({"amount": 2, "multiple": 0}, "multiple must be a positive integer"),
        ({"amount": 2, "scores": [[0.0] * 8]}, "channel scores cover 1 layers, the model has 2"),
        ({"amount": 2, "scores": [[0.0] * 8, [0.0] * 7]}, "layer 1: 7 scores for 8 channels"),
        ({"amount": 2, "scores": [[0.0] * 8, [float("nan")] * 8]}, "layer 1: NaN scores"),
        ({"amount": 2, "scores": [0.0, 1.0]}, "channel scores are a list per layer"),
    ],
)
def test_select_channels_errors(kwargs, message):
    kwargs = {"scores": [[0.0] * 8, [1.0] * 8], **kwargs}
    with pytest.raises(ValueError, match=message):
        select_channels([8, 8], kwargs.pop("scores"), kwargs.pop("amount"), **kwargs)
    with pytest.raises(ValueError, match="channel sizes must be a model or a list"):
        select_channels("8", [[0.0] * 8], 1)


def test_zero_amount_selects_nothing():
    assert select_channels([8], [[0.0] * 8], 0) == {} and select_layers([0.1, 0.2], 0) == []


# -- layers -------------------------------------------------------------------------------


def test_select_layers_removes_the_lowest():
    scores = [0.5, 0.1, 0.9, 0.3]
    assert select_layers(scores, 2) == [1, 3]
    assert select_layers(scores, 0.5) == [1, 3]
    assert select_layers(scores, 3) == [0, 1, 3]
    ties = {tuple(select_layers([1.0] * 6, 2, seed=s)) for s in range(6)}
    assert len(ties) > 1 and select_layers([1.0] * 6, 2, seed=4) == select_layers([1.0] * 6, 2, seed=4)


@pytest.mark.parametrize(
    ("scores", "amount", "kwargs", "message"),
    [
        ([0.1, 0.2, 0.3], 3, {}, "removing 3 of 3 layers would leave fewer than min_layers=1"),
        ([0.1, 0.2, 0.3], 2, {"min_layers": 2}, "would leave fewer than min_layers=2"),
        ([0.1, 0.2, 0.3], 4, {}, "amount 4 is larger than the 3 layers"),
        ([0.1, 0.2, 0.3], 1, {"min_layers": 0}, "min_layers must be at least 1"),
        ([[0.1], [0.2]], 1, {}, "layer scores are one float per layer"),
        ([0.1, float("nan")], 1, {}, "layer 1: a NaN score"),
    ],
)
def test_select_layers_errors(scores, amount, kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_layers(scores, amount, **kwargs)
