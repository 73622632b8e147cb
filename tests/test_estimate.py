"""The dry-run time estimate: the probe's line fit and how stage times follow the recipe."""

from __future__ import annotations

import json

import pytest

from sinv_prune.pipeline.estimate import COMPENSATION_FORWARDS, Probe, Timing, estimate_stages, format_seconds
from sinv_prune.pipeline.recipe import validate_recipe

RECIPE = {
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
    "data": {"synthetic": {"seed": 0}, "tokenizer": {"kind": "word"}, "seq_len": 32},
    "train": {"max_steps": 10, "batch_size": 8},
    "prune": {"arms": [{"criterion": "taylor", "amount": 2}, {"criterion": "magnitude", "amount": 2}]},
    "finetune": {"max_steps": 4, "batch_size": 8, "save_every": 100},
    "evaluate": {"batch_size": 4, "speed_repeats": 2},
}


def fake_probe(fixed: float = 0.1, per_token: float = 0.001) -> Probe:
    line = Timing([(n, fixed + per_token * n) for n in (16, 32, 64)])
    return Probe(
        device="cpu", threads=1, dtype="float32", config_s=1.0, build_s=0.5, param_bytes=10**8,
        forward_backward=line, forward=Timing([(n, t / 3) for n, t in line.points]),
        optimizer_s={"adamw": 0.2}, optimizer_bytes={"adamw": 2 * 10**8}, measures_s=0.3,
        write_bps=10**9, read_bps=2 * 10**9, copy_bps=10**10, trainer_import_s=2.0,
    )  # fmt: skip


def rows(data: dict, tokens=None) -> dict[str, float]:
    tokens = tokens or {"train": 100_000, "valid": 10_000, "test": 10_000}
    return {r.stage: r.seconds for r in estimate_stages(validate_recipe(data), fake_probe(), tokens)}


def test_timing_recovers_a_line_and_extrapolates_it():
    timing = Timing([(n, 0.5 + 0.01 * n) for n in (16, 32, 64, 128)])
    fixed, per_token = timing.line()
    assert fixed == pytest.approx(0.5) and per_token == pytest.approx(0.01)
    assert timing(1000) == pytest.approx(10.5)


def test_timing_never_goes_negative_on_noisy_points():
    timing = Timing([(16, 0.5), (32, 0.4)])  # slower at fewer tokens: noise
    assert timing(1000) > 0.4
    assert Timing([(16, 0.01), (32, 0.5)])(1) >= 0


def test_finetune_time_grows_by_the_added_steps():
    short, long = rows(RECIPE), rows({**RECIPE, "finetune": {**RECIPE["finetune"], "max_steps": 8}})
    step = fake_probe().forward_backward(8 * 32) + 0.2
    for arm in ("taylor-2-global", "magnitude-2-global"):
        assert long[f"finetune {arm}"] - short[f"finetune {arm}"] == pytest.approx(4 * step)
    assert long["train"] == short["train"] and long["evaluate"] == short["evaluate"]


def test_checkpoints_cost_their_weights_and_optimizer_state():
    one, four = rows(RECIPE), rows({**RECIPE, "finetune": {**RECIPE["finetune"], "save_every": 1}})
    per_checkpoint = (10**8 + 2 * 10**8) / 10**9
    assert four["finetune taylor-2-global"] - one["finetune taylor-2-global"] == pytest.approx(3 * per_checkpoint)


def test_evaluation_grows_with_the_tokens_evaluated_and_the_arms():
    small = rows({**RECIPE, "data": {**RECIPE["data"], "max_eval_tokens": 1000}})
    large = rows({**RECIPE, "data": {**RECIPE["data"], "max_eval_tokens": 4000}})
    assert large["evaluate"] > 3 * small["evaluate"] / 2
    three_arms = {**RECIPE, "prune": {"arms": [*RECIPE["prune"]["arms"], {"criterion": "random", "amount": 2}]}}
    assert rows(three_arms)["evaluate"] > rows(RECIPE)["evaluate"]
    assert "prune random-2-global" in rows(three_arms) and "score random" not in rows(three_arms)


def test_format_seconds():
    assert [format_seconds(s) for s in (4.4, 65, 3600 + 25 * 60 + 10)] == ["4s", "1m 05s", "1h 25m"]


def test_compensation_rounds_and_distillation_add_their_passes():
    comp = {"method": "lsq", "batches": 4, "batch_size": 2}
    arms = [{"criterion": "magnitude", "amount": 2, "compensate": comp},
            {"criterion": "magnitude", "amount": 2, "compensate": comp, "rounds": 3, "name": "three"}]  # fmt: skip
    plain = rows(RECIPE)
    recovered = rows({**RECIPE, "prune": {"arms": arms}})
    once = fake_probe().forward(4 * 2 * 32) * COMPENSATION_FORWARDS["lsq"]
    assert recovered["prune magnitude-2-global-lsq"] - plain["prune magnitude-2-global"] == pytest.approx(once)
    rescore = recovered["score magnitude"]
    assert recovered["prune three"] - plain["prune magnitude-2-global"] == pytest.approx(3 * once + 2 * rescore)
    distilled = rows({**RECIPE, "finetune": {**RECIPE["finetune"], "distill": {"teacher": "base"}}})
    teacher = 4 * fake_probe().forward(8 * 32)
    assert distilled["finetune taylor-2-global"] - plain["finetune taylor-2-global"] == pytest.approx(teacher)


def test_unit_and_mixed_arms_score_each_part_once_and_rescore_every_part():
    """An MLP part scores apart from the heads part of the same criterion; a mixed arm prunes in one shot."""
    arms = [{"criterion": "taylor", "amount": 2},
            {"criterion": "taylor", "unit": "mlp", "amount": 0.25, "mode": "uniform", "multiple": 8},
            {"parts": [{"criterion": "taylor", "amount": 2}, {"criterion": "taylor", "unit": "mlp", "amount": 0.25}],
             "name": "mixed"},
            {"criterion": "random", "unit": "layers", "amount": 1}]  # fmt: skip
    out = rows({**RECIPE, "prune": {"arms": arms}})
    assert out["score taylor"] == out["score taylor@mlp"] > 0
    assert not any(stage.startswith("score random") for stage in out)
    one_shot = out["prune taylor-2-global"]
    assert out["prune taylor-mlp-0.25-uniform"] == out["prune random-layers-1-global"] == one_shot
    assert out["prune mixed"] == pytest.approx(one_shot)
    assert {"finetune taylor-mlp-0.25-uniform", "finetune mixed", "finetune random-layers-1-global"} <= set(out)


SMALL_RUN = {
    "name": "estimate-check",
    "seed": 0,
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 64}},
    "data": {"synthetic": {"seed": 0, "num_train": 1500, "num_valid": 100, "num_test": 100},
             "tokenizer": {"kind": "word"}, "seq_len": 64},
    "train": {"max_steps": 60, "batch_size": 32, "learning_rate": 0.003},
    "score": {"batches": 2, "batch_size": 8},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 2}, {"criterion": "taylor", "amount": 2}]},
    "finetune": {"max_steps": 10, "batch_size": 32},
    "evaluate": {"speed_repeats": 2, "speed_batch_size": 4},
}  # fmt: skip


@pytest.mark.slow
def test_dry_run_estimate_is_near_the_real_run(tmp_path, monkeypatch):
    """The probe against the run it estimates, both here and now (so machine load hits both).

    Before the probe sized the LM head by the trained tokenizer's vocabulary (444 words in the
    synthetic corpus, not the 8,000 default) and took the faster of two calls per size, the
    quickstart's estimate was 2.6x its run.
    """
    import time

    from sinv_prune.pipeline import stages
    from sinv_prune.pipeline.estimate import run_probe, run_vocab_size, split_tokens
    from sinv_prune.pipeline.threads import recipe_threads

    recipe = validate_recipe(SMALL_RUN)
    with recipe_threads(recipe, "auto"):
        probe = run_probe(recipe, "cpu")
    estimated = {r.stage: r.seconds for r in estimate_stages(recipe, probe, split_tokens(recipe))}

    measured: dict[str, float] = {}
    for name in ("stage_train", "stage_finetune"):
        real = getattr(stages, name)

        def timed(run, _real=real, _name=name):
            start = time.perf_counter()
            _real(run)
            measured[_name] = time.perf_counter() - start

        monkeypatch.setattr(stages, name, timed)
    start = time.perf_counter()
    stages.run_recipe(recipe, tmp_path / "run", quiet=True)
    measured["total"] = time.perf_counter() - start

    tokenizer = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer.json").read_text())
    assert run_vocab_size(recipe) == len(tokenizer["model"]["vocab"])  # the LM head the run trains
    finetune = sum(s for stage, s in estimated.items() if stage.startswith("finetune "))
    pairs = {
        "train": (estimated["train"], measured["stage_train"]),
        "finetune": (finetune, measured["stage_finetune"]),
        "total": (sum(estimated.values()), measured["total"]),
    }
    ratios = {k: est / real for k, (est, real) in pairs.items()}
    # The target is 1.5x (met by hand on the quickstart, 0.69-0.94, and a shrunk SmolLM2 recipe, 0.79).
    # On this tiny recipe every stage lasts seconds, the real run follows the probe in the same warm
    # process, and a fresh-clone CI run measured 1.50 (total) and 1.64 (fine-tune, 5.4 s vs 3.3 s): a
    # timed test cannot hold 1.5x here without flaking. An idle run on 2026-12-02 measured 2.8x on the
    # fine-tune alone (5.1 s vs 1.8 s) and 2.1x in total, on the code before and after that day's work:
    # a stage of two seconds is mostly fixed cost, and a rerun gave 3.1x and 2.4x. A timed test cannot
    # pin the accuracy (speed targets belong in scripts): this one catches gross errors only (an order
    # of magnitude); the accuracy is recorded per shipped recipe (--dry-run beside the measured wall time
    # in each recipe's header: 0.86-1.07x on the smollm2 recipes and the MoE one).
    shown = {k: (round(e, 1), round(m, 1)) for k, (e, m) in pairs.items()}
    assert all(1 / 4 <= r <= 4 for r in ratios.values()), shown
