"""The consumers a plan cuts: one :class:`Cut` per consumer linear (output projection, MLP down projection);
each unit builds its own (``sinv_prune/units/<unit>/cuts.py``).

Compensation (:mod:`sinv_prune.surgery.compensation`) refits each cut's consumer; OBS may re-choose
which units go, within the quotas a cut carries (per KV group for heads under GQA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from sinv_prune.arch.base import head_rows


@dataclass
class Cut:
    """One consumer of a block losing input columns: ``apply()`` slices the block, ``kept`` columns stay.

    ``kept`` and ``removed`` index the unpruned consumer's input. A unit is ``width`` columns;
    ``quotas`` lists groups of units and how many each loses, and ``choose(units)`` makes the
    plan remove those units instead (OBS). A block's cuts are in forward order.
    """

    unit: str
    consumer: nn.Module
    kept: torch.Tensor
    removed: torch.Tensor
    apply: Callable[[], None]
    width: int = 1
    quotas: list[tuple[list[int], int]] = field(default_factory=list)
    choose: Callable[[list[int]], None] | None = None
    #: the pre-norm whose input is the residual stream the consumer's output is added to (None: not known)
    residual: nn.Module | None = None

    def reselect(self, removed_units: list[int]) -> None:
        """Remove ``removed_units`` instead of the planned ones."""
        units = self.consumer_width // self.width
        keep = [u for u in range(units) if u not in set(removed_units)]
        device = self.kept.device
        self.kept, self.removed = (_columns(torch.tensor(u, dtype=torch.long, device=device), self.width)
                                   for u in (keep, removed_units))  # fmt: skip
        if self.choose is not None:
            self.choose(sorted(removed_units))

    @property
    def consumer_width(self) -> int:
        return self.kept.numel() + self.removed.numel()


def _columns(units: torch.Tensor, width: int) -> torch.Tensor:
    return units if width == 1 else head_rows(units, width)
