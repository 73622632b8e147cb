"""How many models a run holds at once, and the speed comparison's offloading."""

from __future__ import annotations

import gc

import pytest
import torch
from test_pipeline import TINY
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from sinv_prune.pipeline import stages as pipeline
from sinv_prune.pipeline.evaluation import compare_speed, fits_together
from sinv_prune.pipeline.recipe import validate_recipe


def live_models() -> int:
    """Whole models (not their inner base models) in memory, garbage not yet collected included."""
    return sum(issubclass(type(o), PreTrainedModel) and o.base_model is not o for o in gc.get_objects())


@pytest.mark.slow
def test_a_run_with_three_arms_never_holds_more_than_two_models(tmp_path, monkeypatch):
    """Counted at every model load, save, evaluation and fine-tune, with the cyclic garbage collector off
    (so a model kept alive only by a reference cycle counts until the pipeline collects it)."""
    data = {
        **TINY,
        "train": {**TINY["train"], "max_steps": 2, "tracking": None},
        "prune": {"arms": [{"criterion": c, "amount": 2} for c in ("magnitude", "taylor", "random")]},
        "finetune": {**TINY["finetune"], "max_steps": 1},
    }
    counts: list[tuple[str, int]] = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            counts.append((name, live_models()))
            return out

        monkeypatch.setattr(pipeline, name, wrapper)

    for name in ("from_pretrained", "_save_model", "evaluate_model", "run_trainer"):
        counted(name, getattr(pipeline, name))
    gc.collect()
    before = live_models()
    gc.disable()
    try:
        pipeline.run_recipe(validate_recipe(data), tmp_path / "out", quiet=True, threads=1)
    finally:
        gc.enable()
    names = [name for name, _ in counts]
    assert names.count("_save_model") == 1 + 3 + 3  # base, pruned and fine-tuned arms
    assert names.count("run_trainer") == 1 + 3
    assert max(n - before for _, n in counts) == 2, counts


def tiny_gpt2(seed: int, n_head: int = 4) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=n_head, n_embd=32, n_positions=32, vocab_size=50))


def test_offloaded_speed_comparison_moves_one_model_at_a_time(monkeypatch):
    """With ``offload`` each model is sent to the timing device for its own forwards only, the other
    waiting on the CPU; "cpu:0" stands for the device here so that the moves can be told apart."""
    a, b = tiny_gpt2(0), tiny_gpt2(1, n_head=2)
    where = {"a": "start", "b": "start"}
    seen: list[tuple[str, str, str]] = []
    for name, model in (("a", a), ("b", b)):

        def to(device, _name=name, _to=model.to):
            where[_name] = str(device)
            return _to(device)

        monkeypatch.setattr(model, "to", to)
        model.register_forward_pre_hook(lambda m, args, _name=name: seen.append((_name, where["a"], where["b"])))
    out = compare_speed(a, b, batch_size=1, seq_len=8, repeats=3, warmup=1, device="cpu:0", control=True, offload=True)
    assert len(seen) == 3 * 1 + 3 * 3 * 2  # warmup, then each timed forward after one untimed on arrival
    for name, at_a, at_b in seen:
        assert (at_a, at_b) == (("cpu:0", "cpu") if name == "a" else ("cpu", "cpu:0"))
    assert where == {"a": "cpu", "b": "cpu"}  # back where they came from
    assert set(out) >= {"a", "b", "speedup", "speedup_iqr", "control", "resolved"}
    assert len(out["control"]["speedup_iqr"]) == 2 and out["a"]["repeats"] == out["b"]["repeats"] == 3


def test_models_always_fit_together_off_cuda():
    assert fits_together([tiny_gpt2(0), tiny_gpt2(1)], "cpu")
