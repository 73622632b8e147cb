"""OBS picks inside sensitivity / search: with compensate='obs' the trial cuts are the units OBS will remove."""

from __future__ import annotations

import torch
from conftest import model_inputs, tiny_model

import sinv_prune
from sinv_prune.scoring.allocation import groups_for
from sinv_prune.scoring.obs_ranks import rank_by_obs
from sinv_prune.surgery.obs import obs_select


def down_proj_gram(model, layer: int, batches) -> torch.Tensor:
    seen = []
    module = model.model.layers[layer].mlp.down_proj
    handle = module.register_forward_hook(lambda m, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1]).double()))
    with torch.no_grad():
        for b in batches:
            model(**b)
    handle.remove()
    x = torch.cat(seen)
    return x.T @ x


def test_groups_pick_what_greedy_obs_removes():
    model = tiny_model("llama")
    batches = [model_inputs(seed=s, batch=2, length=16) for s in range(4)]
    width = model.config.intermediate_size
    magnitude = [[float(c) for c in range(width)] for _ in range(model.config.num_hidden_layers)]
    groups = groups_for(model, "mlp", magnitude, range(3), min_per_layer=8, multiple=1)
    assert rank_by_obs(model, groups, batches) == 3
    for g in groups:
        gram = down_proj_gram(model, g.layer, batches)
        weight = model.model.layers[g.layer].mlp.down_proj.weight
        for k in (5, 20):
            assert g.pick(k) == obs_select(gram, weight, 1, [(list(range(width)), k)])
    assert groups[0].pick(5) != list(range(5))  # the criterion's own picks would have been these


def test_sensitivity_with_obs_compensation_prunes_to_the_target():
    model = tiny_model("llama")
    batches = [model_inputs(seed=s, batch=2, length=16) for s in range(4)]
    part = sinv_prune.Part("mlp", "magnitude", {"params": 0.1}, allocation="sensitivity", multiple=8)
    pruner = sinv_prune.Pruner([part], compensate="obs")
    before = sinv_prune.count_parameters(model)
    summary = pruner.prune(model, calibration=batches)
    assert summary.params_after < before and pruner.last_allocation
    assert summary.compensation is not None and summary.compensation.method == "obs"
