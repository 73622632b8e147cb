"""Distillation fine-tune (sinv_prune/pipeline/distill.py): loss, masking, every optimizer, recipe key, a run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import VOCAB, tiny_model
from safetensors import safe_open
from test_training import word_tokenizer
from transformers import TrainerCallback, TrainingArguments

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.data import lm_blocks
from sinv_prune.pipeline import stages as pipeline
from sinv_prune.pipeline.distill import DistillClosureTrainer, DistillTrainer, distillation_kl
from sinv_prune.pipeline.preflight import preflight
from sinv_prune.pipeline.recipe import RecipeError, validate_recipe
from sinv_prune.pipeline.training import run_trainer
from sinv_prune.symmetry import ECD

NO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
}
BASE = {
    "model": {"architecture": "gpt2", "config": {"n_layer": 2}},
    "data": {"synthetic": {}, "tokenizer": {"kind": "word"}},
    "train": {"max_steps": 2},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 1}]},
}


def batch(seed: int = 0, rows: int = 4, length: int = 12, mlm: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    labels = ids.clone()
    if mlm:  # a masked LM's labels: only the masked positions count
        masked = torch.rand(ids.shape, generator=g) < 0.3
        masked[:, 0] = True
        labels[~masked] = -100
        ids = ids.masked_fill(masked, 2)
    return {"input_ids": ids, "labels": labels}


def trainer_for(tmp_path, student, teacher, *, alpha=1.0, temperature=2.0, causal=True) -> DistillTrainer:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4)
    return DistillTrainer(
        model=student, args=args, teacher=teacher, temperature=temperature, alpha=alpha, causal=causal
    )


def kl_to(teacher, student, inputs, *, causal=True, temperature=1.0) -> float:
    """The student's mean KL to the teacher on ``inputs``, both in eval mode."""
    with torch.no_grad():
        feed = {k: v for k, v in inputs.items() if k != "labels"}
        s, t = student.eval()(**feed).logits, teacher.eval()(**feed).logits
    return distillation_kl(s, t, inputs["labels"], temperature=temperature, causal=causal).item()


# -- the loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_loss_is_zero_when_the_teacher_is_a_copy_of_the_student(tmp_path, arch):
    student = tiny_model(arch, **NO_DROPOUT[arch]).train()
    trainer = trainer_for(tmp_path, student, copy.deepcopy(student), alpha=1.0, causal=arch != "bert")
    inputs = batch(mlm=arch == "bert")
    loss = trainer.compute_loss(student, inputs)
    assert abs(loss.item()) < 1e-6
    # a different teacher gives a positive KL, so the zero above is not a constant
    other = tiny_model(arch, seed=1, **NO_DROPOUT[arch])
    assert trainer_for(tmp_path, student, other, causal=arch != "bert").compute_loss(student, inputs).item() > 1e-3


def test_alpha_weighs_the_kl_against_the_lm_loss(tmp_path):
    student = tiny_model("llama").train()
    teacher = tiny_model("llama", seed=1)
    inputs = batch()
    with torch.no_grad():
        lm = student(**inputs).loss.item()
    kl = kl_to(teacher, student, inputs, temperature=2.0)
    student.train()
    for alpha in (0.0, 0.3, 1.0):
        loss = trainer_for(tmp_path, student, teacher, alpha=alpha).compute_loss(student, inputs).item()
        assert loss == pytest.approx(alpha * 4 * kl + (1 - alpha) * lm, rel=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_unlabelled_positions_do_not_count(causal):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 6, VOCAB, generator=g), torch.randn(2, 6, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 6), generator=g)
    labels[0, 2] = labels[1, 4] = labels[1, 5] = -100  # padding
    # the logits that predict an unlabelled token: the position before it (causal), or its own
    ignored = [(0, 1), (1, 3), (1, 4), (0, 5), (1, 5)] if causal else [(0, 2), (1, 4), (1, 5)]
    value = distillation_kl(student, teacher, labels, temperature=2.0, causal=causal)
    changed_s, changed_t = student.clone(), teacher.clone()
    for row, col in ignored:
        changed_s[row, col] = 50 * torch.randn(VOCAB, generator=g)
        changed_t[row, col] = 50 * torch.randn(VOCAB, generator=g)
    assert distillation_kl(changed_s, changed_t, labels, temperature=2.0, causal=causal).item() == pytest.approx(
        value.item(), rel=1e-6
    )
    # and it is the plain mean of the per-token KL over the counted positions
    kept = [(r, c) for r in range(2) for c in range(6) if (r, c) not in ignored]
    per_token = [
        torch.sum(
            torch.softmax(teacher[r, c] / 2, -1)
            * (torch.log_softmax(teacher[r, c] / 2, -1) - torch.log_softmax(student[r, c] / 2, -1))
        )
        for r, c in kept
    ]
    assert value.item() == pytest.approx(torch.stack(per_token).mean().item(), rel=1e-5)
    # changing a counted position does change it
    changed_s[kept[0]] += 3 * torch.randn(VOCAB, generator=g)
    assert distillation_kl(changed_s, changed_t, labels, temperature=2.0, causal=causal).item() != pytest.approx(
        value.item(), rel=1e-3
    )


def test_padding_from_the_collator_does_not_count(tmp_path):
    """A batch padded by the Trainer's collator: the padded positions' labels are -100 and the loss ignores them."""
    from transformers import DataCollatorForLanguageModeling

    tok = word_tokenizer()
    collate = DataCollatorForLanguageModeling(tok, mlm=False)
    student, teacher = tiny_model("llama").train(), tiny_model("llama", seed=1)
    short = collate([{"input_ids": [5, 6, 7, 8, 9]}])
    padded = collate([{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [5, 6, 7, 8, 9, 10, 11]}])
    assert (padded["labels"][0, 5:] == -100).all()  # the first row is padded
    trainer = trainer_for(tmp_path, student, teacher, alpha=1.0)
    alone = trainer.compute_loss(student, short)
    feed = {k: v for k, v in padded.items() if k != "labels"}
    with torch.no_grad():  # the second row's own KL, so the mean over counted tokens can be formed
        s, t = student(**feed).logits, teacher(**feed).logits
    row2 = distillation_kl(s[1:], t[1:], padded["labels"][1:], temperature=2.0, causal=True)
    both = trainer.compute_loss(student, padded)
    assert both.item() == pytest.approx((4 * alone.item() + 6 * 4 * row2.item()) / 10, rel=1e-4)


def test_mismatched_vocabularies_are_an_error():
    with pytest.raises(ValueError, match="same vocabulary"):
        distillation_kl(torch.zeros(1, 3, 8), torch.zeros(1, 3, 9), torch.zeros(1, 3, dtype=torch.long),
                        temperature=1.0, causal=True)  # fmt: skip


def test_teacher_is_frozen_in_eval_mode_and_not_part_of_the_model(tmp_path):
    student, teacher = tiny_model("gpt2").train(), tiny_model("gpt2", seed=1).train()
    trainer = trainer_for(tmp_path, student, teacher)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    loss = trainer.compute_loss(student, batch())
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not teacher_ids & {id(p) for p in trainer.model.parameters()}


def test_teacher_takes_the_students_dtype(tmp_path):
    student = tiny_model("llama").to(torch.bfloat16).train()
    teacher = tiny_model("llama", seed=1)
    trainer = trainer_for(tmp_path, student, teacher)
    loss = trainer.compute_loss(student, batch())
    assert torch.isfinite(loss) and {p.dtype for p in teacher.parameters()} == {torch.bfloat16}


def test_bad_temperature_or_alpha_in_the_api(tmp_path):
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        trainer_for(tmp_path, model, copy.deepcopy(model), temperature=0.0)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        trainer_for(tmp_path, model, copy.deepcopy(model), alpha=-0.1)


# -- through run_trainer: a tiny run, every optimizer ----------------------------------------------------


class KeepLogs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def finetune_spec(**finetune):
    distill = finetune.pop("distill", {})
    spec = {"batch_size": 4, "save_every": 100, "distill": distill, **finetune}
    return validate_recipe({**BASE, "finetune": spec}).finetune


def distill_run(tmp_path, student, teacher, steps, callbacks=(), **finetune):
    spec = finetune_spec(max_steps=steps, **finetune)
    ids = torch.randint(3, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    mlm = type(student).__name__.endswith("ForMaskedLM")
    tokenizer = word_tokenizer()
    if mlm:
        tokenizer.add_special_tokens({"mask_token": "w3"})
    return run_trainer(
        student, tokenizer, lm_blocks(ids, 16), None, spec, tmp_path,
        mlm=mlm, seed=0, device="cpu", quiet=True, callbacks=list(callbacks), teacher=teacher,
    )  # fmt: skip


def peaked_teacher():
    """A teacher with confident predictions (scaled output layer), so the student has something to learn."""
    teacher = tiny_model("llama", seed=0)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30)
    return teacher


def test_a_tiny_run_lowers_the_loss_and_the_kl_to_the_teacher(tmp_path):
    teacher = peaked_teacher()
    student = copy.deepcopy(teacher)  # the pruned teacher, as in a recipe
    sinv_prune.prune_heads(student, {0: [0, 3], 1: [1, 4], 2: [2, 5]})
    held_out = batch(seed=5, rows=16, length=16)
    before = kl_to(teacher, student, held_out)
    logs = KeepLogs()
    out = distill_run(tmp_path, student.train(), teacher, 30, [logs], learning_rate=3e-4, save_every=5,
                      distill={"alpha": 1.0, "temperature": 2.0})  # fmt: skip
    assert out.global_step == 30 and len(logs.logs) == 6
    after = kl_to(teacher, student, held_out)
    assert after < 0.5 * before, (before, after)
    first, last = logs.logs[0], logs.logs[-1]
    assert last["loss"] < 0.6 * first["loss"] and last["distill_kl"] < 0.6 * first["distill_kl"]
    assert last["loss"] == pytest.approx(4 * last["distill_kl"], rel=1e-3)  # alpha 1, T 2: the KL term alone
    # the Trainer's checkpoint holds the student only
    with safe_open(str(tmp_path / "checkpoint-30" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(student.state_dict())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape[0] == 4 * 8  # the pruned student's


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "ecd", "soap"])
def test_every_optimizer_steps_on_the_distillation_loss(tmp_path, optimizer, monkeypatch):
    teacher, student = peaked_teacher(), tiny_model("llama", seed=1).train()
    before = [p.detach().clone() for p in student.parameters()]
    seen = []  # the loss ECD's closure hands it, per step
    ecd_step = ECD.step

    def recording_step(self, closure=None):
        seen.append(float(closure()))
        return ecd_step(self, closure)

    monkeypatch.setattr(ECD, "step", recording_step)
    logs = KeepLogs()
    lr = {"ecd": 0.5, "sgd": 0.01}.get(optimizer, 3e-3)
    args = {"F0": 0.0} if optimizer == "ecd" else {}  # F0 well below the loss (KL and LM loss are >= 0)
    out = distill_run(tmp_path, student, teacher, 2, [logs], optimizer=optimizer, learning_rate=lr,
                      optimizer_args=args, save_every=1, distill={"alpha": 0.5, "temperature": 2.0})  # fmt: skip
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, student.parameters(), strict=True))
    assert len(logs.logs) == 2 and all("distill_kl" in x for x in logs.logs)
    if optimizer == "ecd":  # the closure returns the combined loss, not the LM loss alone
        combined = [0.5 * 4 * x["distill_kl"] + 0.5 * x["lm_loss"] for x in logs.logs]
        assert seen == pytest.approx(combined, rel=1e-5)
        assert all(abs(f - x["lm_loss"]) > 1e-3 for f, x in zip(seen, logs.logs, strict=True))
    else:
        assert not seen


def test_ecd_gets_the_closure_trainer_others_the_plain_one():
    from transformers import Trainer

    from sinv_prune.pipeline.distill import distill_trainer_class
    from sinv_prune.symmetry import ClosureTrainer

    assert distill_trainer_class(ClosureTrainer) is DistillClosureTrainer
    assert distill_trainer_class(Trainer) is DistillTrainer
    assert issubclass(DistillClosureTrainer, ClosureTrainer) and not issubclass(DistillTrainer, ClosureTrainer)


def test_masked_lm_distills(tmp_path):
    teacher, student = tiny_model("bert", seed=0), tiny_model("bert", seed=1).train()
    logs = KeepLogs()
    out = distill_run(tmp_path, student, teacher, 2, [logs], save_every=1, distill={"alpha": 1.0})
    assert out.global_step == 2 and all(x["distill_kl"] > 0 for x in logs.logs)


def test_run_trainer_needs_a_teacher_with_distill_and_only_then(tmp_path):
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="no teacher model was given"):
        distill_run(tmp_path, model, None, 1)
    spec = validate_recipe({**BASE, "finetune": {"max_steps": 1}}).finetune
    with pytest.raises(ValueError, match="spec.distill is not set"):
        run_trainer(model, word_tokenizer(), lm_blocks(torch.arange(3, 60), 16), None, spec, tmp_path,
                    mlm=False, seed=0, device="cpu", quiet=True, teacher=copy.deepcopy(model))  # fmt: skip


# -- the recipe ------------------------------------------------------------------------------------


def test_recipe_accepts_distill_under_finetune_with_defaults():
    distill = validate_recipe({**BASE, "finetune": {"distill": {}}}).finetune.distill
    assert (distill.teacher, distill.temperature, distill.alpha, distill.hidden_weight) == ("base", 1.0, 1.0, 0.0)
    assert validate_recipe({**BASE, "finetune": {}}).finetune.distill is None


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"train": {"max_steps": 2, "distill": {}}}, r"^train\.distill: distillation is only for finetune"),
        ({"finetune": {"distill": {"temperature": 0}}}, r"^finetune\.distill\.temperature: .*greater than 0"),
        ({"finetune": {"distill": {"temperature": -1.0}}}, r"^finetune\.distill\.temperature: "),
        ({"finetune": {"distill": {"alpha": 1.5}}}, r"^finetune\.distill\.alpha: .*less than or equal to 1"),
        ({"finetune": {"distill": {"alpha": -0.1}}}, r"^finetune\.distill\.alpha: .*greater than or equal to 0"),
        ({"finetune": {"distill": {"teacher": ""}}}, r"^finetune\.distill\.teacher: "),
        ({"finetune": {"distill": {"temprature": 2}}}, r"^finetune\.distill\.temprature: unknown key"),
    ],
)
def test_recipe_rejects_misplaced_or_bad_distill(recipe, message):
    with pytest.raises(RecipeError, match=message):
        validate_recipe({**BASE, **recipe})


def test_missing_teacher_directory_is_a_preflight_error(tmp_path):
    recipe = validate_recipe({**BASE, "finetune": {"distill": {"teacher": str(tmp_path / "nowhere")}}})
    with pytest.raises(RecipeError, match=r"^finetune\.distill\.teacher: .*nowhere is not a checkpoint directory"):
        preflight(recipe)
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "teacher")
    preflight(validate_recipe({**BASE, "finetune": {"distill": {"teacher": str(tmp_path / "teacher")}}}))


# -- end to end --------------------------------------------------------------------------------------


TINY = {
    "name": "tiny-distill",
    "seed": 0,
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
    "data": {
        "synthetic": {"seed": 0, "num_train": 120, "num_valid": 20, "num_test": 20},
        "tokenizer": {"kind": "word"},
        "seq_len": 32,
    },
    "train": {"max_steps": 4, "batch_size": 8, "learning_rate": 0.003},
    "score": {"batches": 1, "batch_size": 4},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 2}, {"criterion": "random", "amount": 2}]},
    "finetune": {"max_steps": 3, "batch_size": 8, "distill": {"temperature": 2.0, "alpha": 0.7}},
    "evaluate": {"speed": False},
    "report": {"plots": False},
}


def test_recipe_with_distill_runs_records_resumes_and_reloads(tmp_path, monkeypatch):
    """Interrupted after the first arm's distillation, resumed: both arms distilled, recorded and reloadable."""
    recipe = validate_recipe(TINY)
    calls, loads = [], []
    real_trainer, real_load = pipeline.run_trainer, pipeline.load_teacher

    def interrupt_second(*args, **kwargs):
        if "teacher" in kwargs:  # the fine-tune's calls (train's has none)
            calls.append(kwargs["teacher"])
            if len(calls) == 2:
                raise KeyboardInterrupt
        return real_trainer(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_trainer", interrupt_second)
    monkeypatch.setattr(pipeline, "load_teacher", lambda *a: loads.append(1) or real_load(*a))
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_recipe(recipe, tmp_path / "out", quiet=True)
    assert calls[0] is not None and calls[0] is calls[1] and len(loads) == 1  # one teacher for every arm
    monkeypatch.setattr(pipeline, "run_trainer", real_trainer)

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    result = CliRunner().invoke(main, [str(path), "--output", str(tmp_path / "out"), "--quiet", "--resume"])
    assert result.exit_code == 0, result.output
    assert len(loads) == 2  # the resumed run loaded it again for the second arm only
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    state = json.loads((out / "state.json").read_text())
    expected = {"teacher": "base", "temperature": 2.0, "alpha": 0.7}
    for arm in results["arms"]:
        assert arm["distill"] == expected and state["arms"][arm["name"]]["finetune"]["distill"] == expected
        assert arm["model_dir"].endswith("finetuned")
        model = sinv_prune.from_pretrained(out / arm["model_dir"])
        assert sinv_prune.count_parameters(model) == arm["params"]
        with safe_open(str(out / arm["model_dir"] / "model.safetensors"), "pt") as f:
            assert set(f.keys()) <= set(model.state_dict())  # the teacher is not in the checkpoint
    report = (out / "report.md").read_text()
    assert "Fine-tuned by distillation from the teacher `base` (temperature 2, alpha 0.7" in report
    assert "`magnitude-2-global`, `random-2-global`" in report


def test_a_teacher_of_another_vocabulary_or_task_is_refused(tmp_path):
    from types import SimpleNamespace

    tiny_model("gpt2").save_pretrained(tmp_path / "teacher")
    recipe = validate_recipe({**BASE, "finetune": {"distill": {"teacher": str(tmp_path / "teacher")}}})
    run = SimpleNamespace(recipe=recipe, root=tmp_path)
    assert pipeline.load_teacher(run, tiny_model("gpt2", seed=1)).training is False  # same vocabulary: fine
    with pytest.raises(pipeline.RunStageError, match=r"its vocabulary has 64 tokens, the student's 80"):
        student = tiny_model("gpt2")
        student.resize_token_embeddings(80)
        pipeline.load_teacher(run, student)
    with pytest.raises(pipeline.RunStageError, match="a causal LM cannot teach a masked LM"):
        pipeline.load_teacher(run, tiny_model("bert"))
