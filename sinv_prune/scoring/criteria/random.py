"""Random scores: the baseline every criterion has to beat (the paper's "random pruning")."""

from __future__ import annotations

import torch
from torch import nn

from sinv_prune.scoring.criteria.base import Criterion, Scores, to_scores, unit_counts
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.units import get_unit, unit_names


@register_criterion("random")
class RandomCriterion(Criterion):
    """Uniform random scores in [0, 1), reproducible from ``seed``, for every unit.

    The same seed and unit counts give the same scores on every machine (a CPU
    ``torch.Generator``, drawn layer by layer; for ``layers`` one draw per layer).

    .. code-block:: yaml

        criterion: random
        options: {seed: 0}
    """

    units = unit_names()  # every unit registered when the criteria load (the built-in ones)

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def scores(self, model: nn.Module) -> Scores:
        generator = torch.Generator().manual_seed(self.seed)
        values = to_scores(
            torch.rand(n, generator=generator, dtype=torch.float64) for n in unit_counts(model, self.unit)
        )
        return values[0] if get_unit(self.unit).whole_layers else values
