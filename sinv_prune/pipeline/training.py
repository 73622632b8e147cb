"""Train and fine-tune through ``transformers.Trainer`` (data-parallel under ``torchrun`` / ``accelerate launch``)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from transformers import (
    DataCollatorForLanguageModeling,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint, has_length

from sinv_prune.pipeline.device_choice import default_device
from sinv_prune.pipeline.recipe import FinetuneSpec, TrainSpec
from sinv_prune.pipeline.step_budget import budget_steps, planned_steps, tokens_per_step  # noqa: F401
from sinv_prune.progress import bar

logger = logging.getLogger("sinv_prune")


class BarOnly(ProgressCallback):
    """The Trainer's progress bar (a note line outside a terminal, :mod:`sinv_prune.progress`) without the
    metrics dict it prints at every log step: those go to the run log (:class:`LogToLogger`), and to the
    console only at ``sinv-prune -v``."""

    def __init__(self, desc: str = "training"):
        super().__init__()
        self.desc = desc

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = bar(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True)
        self.current_step = 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = bar(total=len(eval_dataloader), desc=f"{self.desc} eval", unit="batch",
                                          leave=self.training_bar is None, dynamic_ncols=True)  # fmt: skip
            self.prediction_bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class LogToLogger(TrainerCallback):
    """Copy the Trainer's log lines (loss, lr, measures) into the run log."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in logs.items()}
            logger.info("step %d: %s", state.global_step, shown)


def optimizer_cls_and_kwargs(spec: TrainSpec) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its keyword arguments: ``learning_rate`` as ``lr`` plus ``optimizer_args``.

    The Trainer builds the optimizer from these over its own parameter groups, so every optimizer
    gets ``weight_decay`` the same way (none on biases and norms). YAML lists become tuples (``betas``).
    """
    from sinv_prune.symmetry.optimizers import check_optimizer_args, optimizer_class

    args = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.optimizer_args.items()}
    check_optimizer_args(spec.optimizer, args)
    return optimizer_class(spec.optimizer), {**args, "lr": spec.learning_rate}


def _add_symmetry_breaking(model, spec) -> None:
    from sinv_prune.symmetry import add_symmetry_breaking, get_symmetry_breaking

    if get_symmetry_breaking(model) is not None:
        return  # already there (restored from the checkpoint's config)
    kwargs = {k: v for k, v in (("b_q", spec.b_q), ("b_v", spec.b_v)) if v != {}}
    add_symmetry_breaking(model, seed=spec.seed, **kwargs)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16); elsewhere torch emulates it, slowly."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: True)() for name in checks)


def run_trainer(
    model,
    tokenizer,
    train_blocks,
    eval_blocks,
    spec: TrainSpec,
    output_dir: Path,
    *,
    mlm: bool,
    seed: int,
    device: str | None,
    quiet: bool,
    callbacks: list[TrainerCallback] = (),
    resume: bool = False,
    teacher: torch.nn.Module | None = None,
    teacher_cache=None,
    desc: str = "training",
):
    """Train ``model`` in place; returns the Trainer's ``TrainOutput``. Checkpoints go to ``output_dir``.

    ``desc`` names the stage on its progress bar or notes. A budget of ``spec.tokens`` becomes
    :func:`planned_steps` (``train_blocks`` give the sequence length, the launcher the processes).

    With ``spec.distill`` the loss is the distillation loss of :mod:`sinv_prune.pipeline.distill` against
    ``teacher`` (frozen, moved to the trainer's device, never saved) or ``teacher_cache`` (one of the two;
    each batch keeps its ``index`` column for the look-up, and only the blocks the cache holds, the first
    ``len(teacher_cache)``, are drawn).
    """
    distill = getattr(spec, "distill", None)
    if distill is not None and teacher is None and teacher_cache is None:
        raise ValueError("spec.distill is set but no teacher model was given")
    if distill is None and (teacher is not None or teacher_cache is not None):
        raise ValueError("a teacher model was given but spec.distill is not set")
    if teacher_cache is not None and len(train_blocks) > len(teacher_cache):
        train_blocks = torch.utils.data.Subset(train_blocks, range(len(teacher_cache)))
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=mlm, mlm_probability=0.15, seed=seed)
    if spec.symmetry_breaking is not None:
        _add_symmetry_breaking(model, spec.symmetry_breaking)
    optimizer_cls, optimizer_kwargs = optimizer_cls_and_kwargs(spec)
    # ECD's update uses g / (F - F0): clipping the gradient would change it, so no clipping by default.
    max_grad_norm = spec.max_grad_norm if spec.max_grad_norm is not None else (0.0 if spec.optimizer == "ecd" else 1.0)
    use_cpu = default_device(device) == "cpu"
    if spec.bf16 and use_cpu and not cpu_has_bf16():
        key = "finetune.bf16" if isinstance(spec, FinetuneSpec) else "train.bf16"
        capability = torch.backends.cpu.get_cpu_capability()
        logger.warning("%s on a CPU without bfloat16 products (%s: no AMX, no AVX512-BF16): torch emulates them, "
                       "slower than float32; drop %s here", key, capability, key)  # fmt: skip
    args = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=spec.epochs,
        max_steps=spec.max_steps or -1,
        per_device_train_batch_size=spec.batch_size,
        per_device_eval_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        # cached teacher rows are looked up by the batch's block index: keep it
        remove_unused_columns=teacher_cache is None,
        train_sampling_strategy="random" if spec.shuffle else "sequential",
        learning_rate=spec.learning_rate,
        weight_decay=spec.weight_decay,
        max_grad_norm=max_grad_norm,
        lr_scheduler_type=spec.lr_scheduler,
        warmup_steps=spec.warmup_ratio,  # a float below 1 is a fraction of the steps
        eval_strategy="steps" if spec.eval_every and eval_blocks is not None else "no",
        eval_steps=spec.eval_every,
        save_strategy="steps",
        save_steps=spec.save_every,
        save_total_limit=1,
        logging_steps=max(1, min(50, spec.save_every)),
        report_to=[],
        seed=seed,
        data_seed=seed,
        use_cpu=use_cpu,
        disable_tqdm=quiet,
        dataloader_num_workers=0,
        # transformers' name for gradient checkpointing; its default (non-reentrant) also gives checkpointed
        # blocks gradients when their inputs are frozen (LoRA's embeddings).
        activation_checkpointing=spec.gradient_checkpointing,
        bf16=spec.bf16,
    )
    if getattr(spec, "tokens", None):
        args.max_steps = planned_steps(spec, len(train_blocks[0]["input_ids"]), args.world_size)
    trainer_cls = Trainer
    if getattr(optimizer_cls, "requires_loss", False):  # ECD: its step needs the loss
        from sinv_prune.symmetry import ClosureTrainer

        trainer_cls = ClosureTrainer
    extra = {}
    if distill is not None:
        from sinv_prune.pipeline.distill import distill_trainer_class

        trainer_cls = distill_trainer_class(trainer_cls)
        extra = {"teacher": teacher, "cache": teacher_cache, "temperature": distill.temperature,
                 "alpha": distill.alpha, "causal": not mlm, "hidden_weight": distill.hidden_weight,
                 "hidden_layers": distill.hidden_layers, "hidden_inputs": distill.hidden_inputs}  # fmt: skip
    trainer = trainer_cls(
        model=model,
        optimizer_cls_and_kwargs=(optimizer_cls, optimizer_kwargs),
        args=args,
        train_dataset=train_blocks,
        eval_dataset=eval_blocks,
        data_collator=collator,
        callbacks=[LogToLogger(), *callbacks],
        **extra,
    )
    trainer.remove_callback(PrinterCallback)  # the metrics reach the run log through LogToLogger
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(BarOnly(desc))
    last = get_last_checkpoint(str(output_dir)) if resume and Path(output_dir).is_dir() else None
    if last:
        logger.info("resuming training from %s", last)
    try:
        return trainer.train(resume_from_checkpoint=last)
    finally:
        _unwrap_forward(model)


def _unwrap_forward(model) -> None:
    """Give ``model`` back its own ``forward``: the Trainer's mixed precision (accelerate) replaces it by one that
    runs under autocast, which would outlive the training (a bf16 fine-tune's model then computing in bfloat16)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__func__", None) is type(model).forward and getattr(original, "__self__", None) is model:
        model.__dict__.pop("forward", None)  # the class's forward again
    else:
        model.forward = original


def remove_checkpoints(output_dir: Path) -> None:
    """Delete the Trainer's ``checkpoint-*`` directories (weights + optimizer state) under ``output_dir``.

    Called once a stage's final model is saved, when nothing can resume from them any more;
    ``output_dir`` itself goes too if that leaves it empty.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return
    for path in output_dir.glob("checkpoint-*"):
        if path.is_dir():
            shutil.rmtree(path)
    if not any(output_dir.iterdir()):
        output_dir.rmdir()
