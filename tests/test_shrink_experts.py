"""shrink on mixture-of-experts models: routed experts in the joint search (tiny random Qwen3-MoE with a dense
layer mixed in, and Mixtral, every layer MoE)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from test_experts import tiny_moe
from test_shrink import heldout_ppl

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.scoring.allocation import non_embedding_parameters


def sequences(n: int = 16, length: int = 40, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(2, 64, (n, length), generator=g))


def shrink(model, share=0.3, **kw):
    kw = {"calibration": sequences(), "budget": 14, "multiple": 4, "quiet": True, **kw}
    return sinv_prune.shrink(model, share, **kw)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_are_searched_and_the_built_model_is_what_was_measured(family, tmp_path):
    model = tiny_moe(family)
    counts = get_adapter(model).expert_counts()
    target = math.ceil(0.3 * non_embedding_parameters(model))
    result = shrink(model)
    assert result.settings["units"][-1] == "experts" and result.shares["experts"] > 0
    # the fill-only seed: experts (and MLP channels in the dense layer, unless the experts' steps past the
    # target gave them back)
    assert any(set(name.split("+")) <= {"mlp", "experts"} and "experts" in name for name in result.seeds)
    assert result.removed >= target and result.params_before - result.params_after == result.removed
    # the candidate masked the removed experts' router logits; the sliced model must compute the same
    assert heldout_ppl(model, sequences()) == pytest.approx(result.heldout_ppl[result.chosen], rel=1e-4)
    kept = get_adapter(model).expert_counts()
    assert sum(counts) - sum(kept) == sum(len(v) for v in result.plan.get("experts", {}).values())
    assert all(k >= model.config.num_experts_per_tok for k in kept if k)
    model.save_pretrained(tmp_path)
    ids = sequences()[2][None]
    with torch.no_grad():
        torch.testing.assert_close(sinv_prune.from_pretrained(tmp_path)(input_ids=ids).logits,
                                   model(input_ids=ids).logits)  # fmt: skip


def test_stock_moe_keeps_one_expert_count_and_reloads_on_the_stock_class(tmp_path):
    model = tiny_moe("mixtral")
    result = shrink(model, 0.35, stock=True)
    kept = get_adapter(model).expert_counts()
    assert len(set(kept)) == 1 and len({(w["heads"], w["kv_heads"]) for w in result.widths if "heads" in w}) == 1
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no remote code
    assert type(reloaded) is transformers.MixtralForCausalLM
    ids = sequences()[3][None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_expert_seeds_are_deterministic_per_seed():
    plans = [shrink(tiny_moe("qwen3_moe"), seed=0).plan for _ in range(2)]
    assert plans[0] == plans[1]


@pytest.mark.parametrize(
    ("family", "units", "message"),
    [("mixtral", ("layers", "heads", "mlp"), "must include 'experts'"),
     ("qwen3_moe", ("heads", "experts"), "must include 'mlp' and 'experts'"),
     (None, ("mlp", "experts"), "no mixture-of-experts layers")],
)  # fmt: skip
def test_units_must_hold_each_layers_fill_unit(family, units, message):
    if family is None:
        from test_shrink import tiny_llama

        model = tiny_llama()
    else:
        model = tiny_moe(family)
    with pytest.raises(ValueError, match=message):
        shrink(model, units=units, calibration=sequences(4))


def test_an_auto_arm_shrinks_a_moe_recipe_by_its_experts(tmp_path):
    import copy
    import json

    from test_moe_recipe import TINY_MOE, invoke, recipe_file

    data = copy.deepcopy(TINY_MOE)
    data["prune"] = {"arms": [{"auto": {"params": 0.3, "budget": 6, "batches": 8}}]}
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    arm = json.loads((tmp_path / "out" / "results.json").read_text())["arms"][0]
    assert arm["shrink"]["shares"]["experts"] > 0 and arm["experts_removed"] > 0
    assert arm["shrink"]["settings"]["units"] == ["layers", "heads", "experts"]  # every unit the model has
    bad = copy.deepcopy(data)
    bad["prune"]["arms"][0]["auto"]["units"] = ["heads", "mlp"]
    refused = invoke(recipe_file(tmp_path, bad), "--output", tmp_path / "bad", "--quiet")
    assert refused.exit_code == 2 and "auto.units" in refused.output and "include experts" in refused.output
    assert not (tmp_path / "bad").exists()


def test_an_expert_cut_is_what_its_plan_pruned_from_scratch_gives():
    # layers and experts need no refit: shrink's build is the plan pruned; rebuilt here on a fresh copy, its
    # parameter count and held-out perplexity (cross-entropy computed here) must be what shrink reports
    model, fresh = tiny_moe("mixtral"), tiny_moe("mixtral")
    result = shrink(model, 0.4, units=("layers", "experts"), budget=10)
    assert result.shares["experts"] > 0
    plan = {u: ({int(k): v for k, v in e.items()} if isinstance(e, dict) else e) for u, e in result.plan.items()}
    before = sum(p.numel() for p in fresh.parameters())
    sinv_prune.prune(fresh, plan)
    after = sum(p.numel() for p in fresh.parameters())
    assert (result.params_before, result.params_after, result.removed) == (before, after, before - after)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in sequences()[7::8]:  # the held-out sequences (1 in 8)
            out = fresh(input_ids=ids[None]).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(out, ids[1:], reduction="sum"))
            count += ids.numel() - 1
    assert math.exp(total / count) == pytest.approx(result.heldout_ppl[result.chosen], rel=1e-4)


def test_every_moe_seed_kind_meets_the_target_when_it_wins(monkeypatch):
    # on the Qwen3-MoE with a dense layer: each seed forced to win (the only seed, no search) removes the target
    # and less than one fill step more (the larger: an expert with its router row; 4 dense MLP channels)
    import copy
    import importlib

    search = importlib.import_module("sinv_prune.shrink.search")
    real = search.seed_genomes
    reference = tiny_moe("qwen3_moe")
    hidden, moe_width = reference.config.hidden_size, reference.config.moe_intermediate_size
    step = max(3 * hidden * moe_width + hidden, 4 * 3 * hidden)
    statistics, kinds = None, set()
    for share in (0.3, 0.45):
        monkeypatch.setattr(search, "seed_genomes", real)
        names = shrink(copy.deepcopy(reference), share, budget=1, statistics=statistics).seeds
        for name in names:
            monkeypatch.setattr(search, "seed_genomes", lambda s, b, r, name=name: {name: real(s, b, r)[name]})
            model = copy.deepcopy(reference)
            result = shrink(model, share, budget=1, statistics=statistics, keep_statistics=True)
            statistics = result.statistics  # of the unpruned model: the same for every copy
            assert list(result.seeds) == [name]
            assert result.target <= result.removed < result.target + step, (share, name)
            assert sum(p.numel() for p in model.parameters()) == result.params_before - result.removed
            kinds.add(name)
    assert {"experts", "heads+experts", "layers+experts"} <= kinds


def test_the_experts_removed_are_those_with_the_lowest_reap_scores():
    # in each MoE layer the plan removes experts that score no higher than any kept one, by the statistics' REAP
    # scores (which test_consumer_statistics checks against a whole-model REAP pass)
    model = tiny_moe("mixtral")
    result = shrink(model, 0.4, units=("layers", "experts"), budget=10, keep_statistics=True)
    scores = result.statistics.expert_scores
    assert result.plan.get("experts")
    for layer, removed in result.plan["experts"].items():
        row = scores[int(layer)]
        kept = [e for e in range(len(row)) if e not in removed]
        assert len(set(row)) == len(row)  # no ties: the order is the scores'
        assert max(row[e] for e in removed) < min(row[e] for e in kept)
    result.statistics.close()
