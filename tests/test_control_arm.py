"""A control arm (the unpruned model fine-tuned like every arm), bf16 mixed-precision fine-tuning, and recovery
curves without tasks."""

from __future__ import annotations

import json

import pytest
from test_pipeline import TINY, invoke, recipe_file

from sinv_prune.pipeline.recipe import ArmSpec

CONTROL = {
    **TINY,
    "name": "control",
    "train": {"max_steps": 4, "batch_size": 8},
    "prune": {"arms": [{"control": True}, {"criterion": "magnitude", "amount": 2}]},
    "finetune": {"max_steps": 3, "batch_size": 4, "learning_rate": 0.01},
}


def test_a_control_arm_is_the_base_fine_tuned_like_the_pruned_arms(tmp_path):
    result = invoke(recipe_file(tmp_path, CONTROL), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    arms = {a["name"]: a for a in results["arms"]}
    control, pruned = arms["control"], arms["magnitude-2-global"]
    base = results["baseline"]
    assert control["criterion"] == "none" and control["unit"] == "none"
    assert control["heads_removed"] == 0 and control["pruned"]["params"] == base["params"]
    assert control["pruned"]["perplexity"] == base["perplexity"]  # its starting point is the base itself
    assert control["finetuned"]["params"] == base["params"]
    assert control["finetuned"]["perplexity"] != base["perplexity"]  # trained: the control is not a copy
    assert control["finetune_tokens"] == pruned["finetune_tokens"] > 0
    assert pruned["pruned"]["params"] < base["params"]


@pytest.mark.parametrize(
    "arm",
    [{"control": True, "criterion": "magnitude"}, {"control": True, "auto": {"params": 0.2}},
     {"control": True, "amount": 2}],
)  # fmt: skip
def test_a_control_arm_that_also_prunes_is_refused_in_one_line(arm):
    with pytest.raises(ValueError, match="a control arm prunes nothing"):
        ArmSpec.model_validate(arm)


def test_bf16_fine_tuning_trains_under_autocast_and_keeps_float32_weights(tmp_path):
    import torch
    from conftest import tiny_model
    from test_distill import finetune_spec
    from test_recovery_finetune import random_blocks, train

    losses = {}
    for bf16 in (False, True):
        model = tiny_model("llama").train()
        out = train(tmp_path / str(bf16), model, random_blocks(), finetune_spec(max_steps=2, distill=None, bf16=bf16))
        losses[bf16] = out.training_loss
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[True] != losses[False]  # bfloat16 products: not the float32 run


@pytest.mark.parametrize(("native", "stage"), [(False, "finetune"), (True, "finetune"), (False, "train")])
def test_bf16_on_a_cpu_without_bf16_products_warns(tmp_path, monkeypatch, caplog, native, stage):
    import torch
    from conftest import tiny_model
    from test_distill import finetune_spec
    from test_recovery_finetune import random_blocks, train

    from sinv_prune.pipeline.recipe import TrainSpec

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    if stage == "train":  # the train stage's spec: the warning names the train section's key
        spec = TrainSpec.model_validate({"max_steps": 1, "batch_size": 4, "save_every": 100, "bf16": True})
    else:
        spec = finetune_spec(max_steps=1, distill=None, bf16=True)
    with caplog.at_level("WARNING", logger="sinv_prune"):
        train(tmp_path, tiny_model("llama").train(), random_blocks(), spec)
    warned = [r.getMessage() for r in caplog.records if "bf16 on a CPU" in r.getMessage()]
    assert bool(warned) != native and all(m.startswith(f"{stage}.bf16") and f"drop {stage}.bf16" in m for m in warned)


def test_a_curve_without_tasks_measures_perplexity_only(monkeypatch):
    import math
    from types import SimpleNamespace

    import torch
    from test_recovery_finetune import BASE, VOCAB, tiny_model, validate_recipe, word_tokenizer

    import sinv_prune.lmeval as lmeval
    from sinv_prune.pipeline.recovery import curve_evaluator

    finetune = {"max_steps": 1, "eval_every_tokens": 10, "eval_max_tokens": 40, "eval_tasks": False}
    recipe = validate_recipe({**BASE, "data": {**BASE["data"], "seq_len": 16}, "evaluate": {"tasks": ["a"]},
                              "finetune": finetune})  # fmt: skip
    ids = torch.randint(3, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    run = SimpleNamespace(recipe=recipe, ids={"test": ids}, tokenizer=word_tokenizer(), root="/nowhere")
    monkeypatch.setattr(lmeval, "evaluate_tasks", lambda *a, **k: pytest.fail("a task ran at a curve point"))
    point = curve_evaluator(run, masked_lm=False)(tiny_model("gpt2"))
    assert list(point) == ["perplexity"] and math.isfinite(point["perplexity"])


def test_the_dry_run_counts_a_control_arm_once(tmp_path):
    result = invoke(recipe_file(tmp_path, CONTROL), "--output", tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "arm control: prunes nothing" in result.output
    # baseline, the control fine-tuned, the magnitude arm pruned and fine-tuned: the control's start is the baseline
    assert "4 models x" in result.output and "5 models x" not in result.output


def test_a_bf16_curve_point_measures_the_float32_model(tmp_path):
    import torch
    from conftest import tiny_model
    from test_distill import finetune_spec
    from test_recovery_finetune import random_blocks, train

    from sinv_prune.pipeline.evaluation import perplexity
    from sinv_prune.pipeline.recovery import RecoveryCurve

    ids = torch.randint(3, 60, (160,), generator=torch.Generator().manual_seed(3))

    def evaluate(model):
        return {"perplexity": perplexity(model, ids, seq_len=16, progress=False)["perplexity"]}

    model = tiny_model("llama").train()
    curve = RecoveryCurve(evaluate, 64, 16, tmp_path / "curve.json")
    spec = finetune_spec(max_steps=3, distill=None, bf16=True, learning_rate=1e-2)
    train(tmp_path, model, random_blocks(), spec, callbacks=[curve])
    assert "forward" not in model.__dict__  # run_trainer gave the model its own forward back
    final = perplexity(model.eval(), ids, seq_len=16, progress=False)["perplexity"]
    assert curve.points[-1]["step"] == 3 and curve.points[-1]["perplexity"] == pytest.approx(final, rel=1e-9)
