"""Criteria: a registry from name to :class:`Criterion` class.

A criterion scores one unit: attention ``heads``, ``mlp`` channels, MoE ``experts`` or whole ``layers``
(``Criterion.units`` lists those a class can score; ``get_criterion(name, unit=...)``
picks one, default ``"heads"``). Built in, by unit:

* heads: ``random``, ``magnitude``, ``sinv_static``, ``sinv_gauge``, ``sinv_early``,
  ``taylor``, ``entropy``, ``activation``;
* mlp: ``random``, ``magnitude``, ``taylor``, ``activation``;
* experts: ``random``, ``magnitude``, ``frequency``, ``reap``, ``ean``, ``sinv_static``, ``sinv_early``;
* layers: ``random``, ``block_influence``, ``sinv_depth``.

Users add their own with the decorator::

    @register_criterion("my_score")
    class MyScore(Criterion):
        units = ("heads", "mlp")

        def scores(self, model):
            ...  # scores of self.unit

and name it in a recipe (options are the class's constructor keywords)::

    prune:
      criterion: my_score
      options: {}
"""

from __future__ import annotations

from sinv_prune.scoring.criteria import (  # noqa: F401  (registration)
    activation,
    entropy,
    layers,
    magnitude,
    random,
    routing,
    sinv,
    taylor,
)
from sinv_prune.scoring.criteria.activation import ActivationCriterion
from sinv_prune.scoring.criteria.base import Criterion, Scores, StoredScores, TraceLike
from sinv_prune.scoring.criteria.entropy import EntropyCriterion
from sinv_prune.scoring.criteria.layers import BlockInfluenceCriterion, SinvDepthCriterion
from sinv_prune.scoring.criteria.magnitude import MagnitudeCriterion
from sinv_prune.scoring.criteria.random import RandomCriterion
from sinv_prune.scoring.criteria.registry import available_criteria, criterion_class, get_criterion, register_criterion
from sinv_prune.scoring.criteria.routing import EanCriterion, FrequencyCriterion, ReapCriterion, RoutingCriterion
from sinv_prune.scoring.criteria.sinv import SinvEarlyCriterion, SinvGaugeCriterion, SinvStaticCriterion
from sinv_prune.scoring.criteria.taylor import TaylorCriterion

__all__ = [
    "ActivationCriterion",
    "BlockInfluenceCriterion",
    "Criterion",
    "EanCriterion",
    "EntropyCriterion",
    "FrequencyCriterion",
    "MagnitudeCriterion",
    "RandomCriterion",
    "ReapCriterion",
    "RoutingCriterion",
    "Scores",
    "StoredScores",
    "SinvEarlyCriterion",
    "SinvDepthCriterion",
    "SinvGaugeCriterion",
    "SinvStaticCriterion",
    "TaylorCriterion",
    "TraceLike",
    "available_criteria",
    "criterion_class",
    "get_criterion",
    "register_criterion",
]
