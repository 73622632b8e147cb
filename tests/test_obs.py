"""OBS selection (``compensate="obs"``): greedy structured OBS picks the units to remove, then the lsq refit."""

from __future__ import annotations

import copy

import torch
from conftest import model_inputs, model_output, tiny_model
from test_compensation import calibration, make_redundant

import sinv_prune
from sinv_prune import Part, Pruner
from sinv_prune.arch import get_adapter
from sinv_prune.scoring.criteria.base import Criterion
from sinv_prune.surgery.obs import obs_select
from sinv_prune.surgery.record import get_record


def duplicate_channels(model, layer: int, pairs: dict[int, int], scale: float = 2.0) -> None:
    """LLaMA MLP: channel ``c`` computes ``scale x`` channel ``source`` (same gate row, scaled up row)."""
    mlp = get_adapter(model).layers()[layer].mlp
    with torch.no_grad():
        for c, source in pairs.items():
            mlp.gate_proj.weight[c] = mlp.gate_proj.weight[source]
            mlp.up_proj.weight[c] = scale * mlp.up_proj.weight[source]
            mlp.down_proj.weight[:, c] *= 5  # large, so that losing it shows


def test_obs_picks_dependent_columns_and_the_refit_is_exact():
    model = tiny_model("llama")
    dup = {0: {10: 3, 20: 4, 30: 5}, 2: {7: 1, 40: 2}}
    for layer, pairs in dup.items():
        duplicate_channels(model, layer, pairs)
    reference, lsq = copy.deepcopy(model), copy.deepcopy(model)
    plan = {"mlp": {0: [0, 1, 2], 2: [50, 60]}}  # as many channels as are duplicates, but the wrong ones
    options = dict(calibration=calibration(), ridge=1e-10, precision="float64", holdout=0)
    sinv_prune.prune(lsq, plan, compensate="lsq", **options)
    summary = sinv_prune.prune(model, plan, compensate="obs", **options)

    removed = {c.layer: set(c.removed) for c in summary.mlp}
    for layer, pairs in dup.items():  # one channel of each duplicate pair (either may absorb the other)
        assert len(removed[layer]) == len(pairs) and all(len({c, s} & removed[layer]) == 1 for c, s in pairs.items())
    record = get_record(model.config)
    assert {k: set(v) for k, v in record.pruned_mlp.items()} == removed  # the record follows OBS's choice
    assert all(f.error_after < 1e-6 for f in summary.compensation.layers)
    inputs = model_inputs(seed=7, batch=3, length=20)
    expected = model_output(reference, inputs)
    torch.testing.assert_close(model_output(model, inputs), expected, atol=1e-4, rtol=0)
    assert (model_output(lsq, inputs) - expected).abs().max() > 1e-3  # lsq on the planned channels cannot


def test_obs_on_heads_chooses_within_kv_groups_and_reloads(tmp_path):
    model = tiny_model("gpt2")  # every head its own KV head: OBS chooses among all heads of a layer
    make_redundant(model, 1, 3, 0, seed=1)
    reference = copy.deepcopy(model)
    summary = sinv_prune.prune_heads(
        model, {1: [1]}, calibration=calibration(), compensate="obs", ridge=1e-10, precision="float64", holdout=0
    )
    assert [c.removed for c in summary.layers] in ([[3]], [[0]])  # the copy or its source, not the planned head
    inputs = model_inputs(seed=7, batch=3, length=20)
    torch.testing.assert_close(model_output(model, inputs), model_output(reference, inputs), atol=1e-4, rtol=0)
    model.save_pretrained(tmp_path)
    again = sinv_prune.from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(model_output(again, inputs), model_output(model, inputs))


def test_obs_keeps_the_gqa_layout():
    model = tiny_model("llama")  # 6 query heads, 2 KV groups of 3
    summary = sinv_prune.prune_heads(model, {0: [0, 3], 2: [0, 1, 3, 4]}, calibration=calibration(), compensate="obs")
    per_group = {c.layer: sorted(h // 3 for h in c.removed) for c in summary.layers}
    assert per_group == {0: [0, 1], 2: [0, 0, 1, 1]}
    assert all(c.kept_kv == 2 for c in summary.layers)
    assert model_output(model, model_inputs()).isfinite().all()


def test_obs_select_quotas_and_exactness():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g, dtype=torch.float64)
    x = torch.cat([x, 3 * x[:, :2]], dim=1)  # columns 6, 7 are copies of 0, 1
    weight = torch.randn(4, 8, generator=g, dtype=torch.float64)
    pairs = ({0, 6}, {1, 7})
    chosen = obs_select(x.T @ x, weight, 1, [(list(range(8)), 2)])
    assert all(len(p & set(chosen)) == 1 for p in pairs)  # one of each pair: nothing is lost
    chosen = obs_select(x.T @ x, weight, 1, [([0, 2, 3, 4], 1), ([1, 5, 6, 7], 2)])
    assert chosen[0] == 0 and len({1, 7} & set(chosen)) == 1 and len(chosen) == 3  # quotas per group
    blocks = obs_select(x.T @ x, weight, 2, [(list(range(4)), 1)])  # units of 2 columns: unit 3 copies unit 0
    assert blocks in ([0], [3])


class Fixed(Criterion):
    """Scores given up front (lowest goes first), so the plan is known before OBS changes it."""

    name = "fixed"

    def __init__(self, unit: str, rows: list):
        self.units, self.rows = (unit,), rows

    def scores(self, model):
        return self.rows


OBS_OPTIONS = dict(ridge=1e-10, precision="float64", holdout=0)


def test_pruner_reports_the_channels_obs_removed_not_the_planned_ones():
    model = tiny_model("llama")  # 3 layers of 64 channels
    duplicate_channels(model, 0, {10: 3, 20: 4, 30: 5})
    original = get_adapter(model).layers()[0].mlp.gate_proj.weight.detach().clone()
    rows = [[0.0] * 3 + [1.0] * 61] + [[10 + 0.01 * j for j in range(64)] for _ in range(2)]
    part = Part("mlp", Fixed("mlp", rows), 3)
    assert Pruner([part]).select(copy.deepcopy(model)) == {"mlp": {0: [0, 1, 2]}}  # the plan
    pruner = Pruner([part], compensate="obs", compensation_options=OBS_OPTIONS)
    summary = pruner.prune(model, calibration=calibration())

    record = get_record(model.config).pruned_mlp
    assert list(record) == [0] and record[0] != [0, 1, 2]  # OBS took one of each duplicate pair instead
    kept = [c for c in range(64) if c not in record[0]]  # the rows still in the model are the others
    assert torch.equal(get_adapter(model).layers()[0].mlp.gate_proj.weight, original[kept])
    assert pruner.last_selection == {"mlp": {0: record[0]}} == {"mlp": {c.layer: c.removed for c in summary.mlp}}
    report = pruner.report()
    assert report["selection"] == {"mlp": {"0": record[0]}}
    assert [r["selection"] for r in report["per_round"]] == [{"mlp": {"0": record[0]}}]


def test_head_pruner_rounds_report_the_heads_obs_removed():
    model = tiny_model("gpt2")  # 3 layers of 4 heads, each its own KV head
    make_redundant(model, 1, 3, 0, seed=1)
    rows = [[1.0] * 4, [1.0, 0.0, 1.0, 1.0], [1.0] * 4]  # the plan: layer 1's head 1
    pruner = Pruner([Part("heads", Fixed("heads", rows), 1)], compensate="obs", compensation_options=OBS_OPTIONS)
    pruner.prune(model, calibration=calibration())

    removed = get_record(model.config).pruned_heads
    assert removed in ({1: [3]}, {1: [0]})  # the copy or its source, not the planned head 1
    assert pruner.last_selection == {"heads": removed}
    assert pruner.report()["selection"] == {"heads": {"1": removed[1]}}
    assert pruner.report()["per_round"][0]["selection"] == {"heads": {"1": removed[1]}}
