"""Optimizer steps of a training spec: ``max_steps``, or a token budget turned into steps."""

from __future__ import annotations

import math

from sinv_prune.pipeline.recipe import TrainSpec


def tokens_per_step(spec: TrainSpec, seq_len: int, world_size: int = 1) -> int:
    """Tokens one optimizer step trains on: ``batch_size * seq_len * gradient_accumulation_steps * world_size``."""
    return spec.batch_size * seq_len * spec.gradient_accumulation_steps * world_size


def budget_steps(tokens: int, per_step: int) -> int:
    """Optimizer steps of a token budget: ``ceil(tokens / per_step)`` (at least the budget, less than a step more)."""
    return math.ceil(tokens / per_step)


def planned_steps(spec: TrainSpec, seq_len: int, world_size: int = 1) -> int | None:
    """``max_steps``, or the steps of ``tokens`` (a fine-tune's budget); None when the epochs decide."""
    if getattr(spec, "tokens", None):
        return budget_steps(spec.tokens, tokens_per_step(spec, seq_len, world_size))
    return spec.max_steps
