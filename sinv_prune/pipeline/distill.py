"""Distillation fine-tune: the pruned student learns the frozen teacher's logits, through ``transformers.Trainer``.

The loss of a training batch (Hinton et al. 2015's convention, as Minitron and Sheared-LLaMA use it)::

    loss = alpha * T**2 * KL(softmax(z_teacher / T) || softmax(z_student / T)) + (1 - alpha) * LM loss

The KL is summed over the vocabulary and averaged over the tokens that carry a label: each position
whose next token is a label for a causal LM (the LM loss's own shift), only the masked positions for
a masked LM; ``-100`` labels (padding) never count. ``T**2`` keeps the gradient's scale independent
of the temperature. ``alpha = 1`` is pure distillation, ``alpha = 0`` plain LM fine-tuning.

:class:`DistillTrainer` (and :class:`DistillClosureTrainer` for ECD, whose step needs the loss)
computes it in ``compute_loss``, so the Trainer's backward, gradient accumulation, clipping,
optimizer step and ``accelerate launch`` apply unchanged. The teacher is an attribute of the trainer,
not of the model: it is never wrapped by DDP, never saved in checkpoints; it runs in eval mode (so
dropout is off and symmetry-breaking biases use their mean), without gradients, moved on first use
to the trainer's device and the student's dtype. Evaluation batches keep the plain LM loss, so
``eval_loss`` stays a perplexity.

With a ``cache`` (:class:`sinv_prune.pipeline.distill_cache.TeacherCache`, ``distill.cache_top_k``) there is
no teacher at training time: each batch carries its blocks' ``index``, the cached top-k rows are looked
up by it and the KL is :func:`~sinv_prune.pipeline.distill_cache.topk_kl` over the teacher's top-k support.

``hidden_weight > 0`` (live teacher only) adds ``hidden_weight * L_hidden``, the relative squared error between
the student's block outputs and those of the teacher blocks they descend from; with ``hidden_inputs
"teacher"`` each student block is run on its teacher block's input for that term (a layer-wise loss)
(:mod:`sinv_prune.pipeline.distill_hidden`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from transformers import Trainer

from sinv_prune.pipeline.recipe import Recipe, RecipeError
from sinv_prune.symmetry.trainer import ClosureTrainer


def distillation_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    causal: bool,
) -> torch.Tensor:
    """Mean over labelled tokens of ``KL(teacher_T || student_T)`` over the vocabulary (float32, no ``T**2``).

    ``causal``: logits at position ``t`` predict token ``t + 1``, so a position counts when
    ``labels[t + 1] != -100`` (the last position never does); otherwise when ``labels[t] != -100``.
    Zero (with a gradient path) when no token counts.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(teacher_logits.shape)} do not match the student's {tuple(student_logits.shape)}"
            " (the teacher needs the same vocabulary)"
        )
    if causal:
        student_logits, teacher_logits, labels = student_logits[:, :-1], teacher_logits[:, :-1], labels[:, 1:]
    keep = labels != -100
    student = F.log_softmax(student_logits[keep].float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits[keep].float() / temperature, dim=-1)
    total = F.kl_div(student, teacher, log_target=True, reduction="sum")
    return total / keep.sum().clamp(min=1)


class DistillMixin:
    """``compute_loss`` = ``alpha * T**2 * KL + (1 - alpha) * LM loss`` on training batches (see the module).

    Both terms are means over this micro-batch's labelled tokens, so the Trainer divides the sum
    by the gradient accumulation steps itself (``loss_is_scaled_for_ga = False``).
    """

    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args,
        teacher: nn.Module | None = None,
        temperature: float = 2.0,
        alpha: float = 0.5,
        causal: bool,
        cache=None,
        hidden_weight: float = 0.0,
        hidden_layers: list[int] | None = None,
        hidden_inputs: str = "student",
        **kw,
    ):
        if not temperature > 0:
            raise ValueError(f"distillation temperature must be > 0, got {temperature}")
        if not 0 <= alpha <= 1:
            raise ValueError(f"distillation alpha must be in [0, 1], got {alpha}")
        if (teacher is None) == (cache is None):
            raise ValueError("distillation needs a teacher model or a teacher cache (one of the two)")
        if cache is not None and not causal:
            raise ValueError("a teacher cache is for causal LMs (a masked LM's teacher sees a new masking each step)")
        if hidden_weight < 0:
            raise ValueError(f"distillation hidden_weight must be >= 0, got {hidden_weight}")
        if hidden_weight and teacher is None:
            raise ValueError("distill.hidden_weight needs the live teacher (its hidden states are not cached)")
        if hidden_inputs not in ("student", "teacher"):
            raise ValueError(f"distill.hidden_inputs must be 'student' or 'teacher', got {hidden_inputs!r}")
        self.teacher = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.cache = cache
        self.temperature, self.alpha, self.causal = float(temperature), float(alpha), causal
        self.hidden_weight = float(hidden_weight)
        self._teacher_placed: tuple | None = None
        self._distill_logged: list[torch.Tensor] = []
        super().__init__(*args, **kw)
        self._hidden = None
        if self.hidden_weight:
            from sinv_prune.pipeline.distill_hidden import BlockOutputs, layer_pairs

            student = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # LoRA
            pairs = layer_pairs(student, self.teacher, hidden_layers)
            forced = hidden_inputs == "teacher"  # the layer-wise loss: each block fed the teacher's input
            self._hidden = (pairs, BlockOutputs(student, [s for s, _ in pairs], calls=forced),
                            BlockOutputs(self.teacher, [t for _, t in pairs], calls=forced), forced)  # fmt: skip

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            inputs = {k: v for k, v in inputs.items() if k != "index"}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError("distillation needs 'labels' in the batch: they say which tokens count")
        index = inputs.get("index")
        inputs = {k: v for k, v in inputs.items() if k != "index"}
        if self.cache is not None and index is None:
            raise ValueError("distillation from a teacher cache needs the blocks' 'index' in the batch")
        # No num_items_in_batch: the LM loss is this micro-batch's mean, like the KL term.
        with self._hidden[1] if self._hidden else contextlib.nullcontext():
            lm_loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        student_logits = outputs["logits"]
        if self.cache is not None:
            from sinv_prune.pipeline.distill_cache import topk_kl

            values, ids = self.cache.rows(index, student_logits.device)
            kl = topk_kl(student_logits, values, ids, labels, temperature=self.temperature, causal=self.causal)
        else:
            teacher_logits = self._teacher_logits(inputs).to(student_logits.device)
            kl = distillation_kl(
                student_logits, teacher_logits, labels, temperature=self.temperature, causal=self.causal
            )
        loss = self.alpha * self.temperature**2 * kl + (1 - self.alpha) * lm_loss
        logged = [kl.detach(), lm_loss.detach().mean().float()]
        if self._hidden:
            from sinv_prune.pipeline.distill_hidden import forced_outputs, hidden_loss

            pairs, student_out, teacher_out, forced = self._hidden
            keep = labels != -100
            if forced:
                ours = forced_outputs(student_out, teacher_out, pairs)
                student_out.take()  # forget the student's own outputs and calls
            else:
                ours = student_out.take()
            hidden = hidden_loss(ours, teacher_out.take(), pairs, keep)
            loss = loss + self.hidden_weight * hidden
            logged.append(hidden.detach())
        self._distill_logged.append(torch.stack(logged))
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def _teacher_logits(self, inputs: dict) -> torch.Tensor:
        self._place_teacher()
        self.teacher.eval()
        with self._hidden[2] if self._hidden else contextlib.nullcontext():
            return self.teacher(**{k: v for k, v in inputs.items() if k != "labels"}).logits

    def _place_teacher(self) -> None:
        """Move the teacher to this process's device and the student's dtype (once; again if they change)."""
        student = self.accelerator.unwrap_model(self.model)
        dtype = next((p.dtype for p in student.parameters() if p.is_floating_point()), None)
        target = (self.accelerator.device, dtype)
        if self._teacher_placed != target:
            if getattr(self.teacher, "hf_device_map", None) is not None:  # placed by a device_map: keep it there
                self.teacher.to(dtype=dtype)
            else:
                self.teacher.to(device=target[0], dtype=dtype)
            self._teacher_placed = target

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the mean KL and LM loss of the training batches since the last log (this process's)."""
        if "loss" in logs and self._distill_logged:
            means = torch.stack(self._distill_logged).mean(dim=0).tolist()
            logs = {**logs, **dict(zip(("distill_kl", "lm_loss", "hidden_loss"), means, strict=False))}
            self._distill_logged = []
        super().log(logs, *args, **kwargs)


class DistillTrainer(DistillMixin, Trainer):
    """A ``Trainer`` that fine-tunes by distillation from ``teacher`` (keyword arguments of :class:`DistillMixin`)."""


class DistillClosureTrainer(DistillMixin, ClosureTrainer):
    """:class:`DistillTrainer` for optimizers whose step needs the loss (ECD): the closure returns the combined loss."""


def distill_trainer_class(base: type[Trainer]) -> type[Trainer]:
    """The distilling variant of the Trainer class ``run_trainer`` would use."""
    return DistillClosureTrainer if issubclass(base, ClosureTrainer) else DistillTrainer


def check_teacher(recipe: Recipe) -> None:
    """``RecipeError`` before any work when ``finetune.distill.teacher`` names a directory without a checkpoint."""
    distill = recipe.finetune.distill if recipe.finetune is not None else None
    if distill is None or distill.teacher == "base":
        return
    path = Path(recipe.resolve(distill.teacher))
    if not (path / "config.json").is_file():
        raise RecipeError(
            f"finetune.distill.teacher: {path} is not a checkpoint directory (no config.json); "
            "give 'base' or a saved model's directory"
        )
