"""Criteria: a registry from name to :class:`Criterion` class.

A criterion scores one unit: attention ``heads``, ``mlp`` channels or whole ``layers``
(``Criterion.units`` lists those a class can score; ``get_criterion(name, unit=...)``
picks one, default ``"heads"``). Built in, by unit:

* heads: ``random``, ``magnitude``, ``sinv_static``, ``sinv_gauge``, ``sinv_early``,
  ``taylor``, ``entropy``, ``activation``;
* mlp: ``random``, ``magnitude``, ``taylor``, ``activation``;
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

import inspect
import re

from sinv_prune.scoring.criteria.base import Criterion, Scores, StoredScores, TraceLike

_CRITERIA: dict[str, type[Criterion]] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_criterion(name: str):
    """Class decorator: register a :class:`Criterion` subclass under ``name`` (lower snake case)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"criterion name must be lower snake case, got {name!r}")

    def decorator(cls: type[Criterion]) -> type[Criterion]:
        if not (isinstance(cls, type) and issubclass(cls, Criterion)):
            raise TypeError(f"@register_criterion({name!r}) needs a Criterion subclass, got {cls!r}")
        if name in _CRITERIA:
            raise ValueError(f"criterion {name!r} is already registered ({_CRITERIA[name].__name__})")
        cls.name = name
        _CRITERIA[name] = cls
        return cls

    return decorator


def available_criteria() -> list[str]:
    """Registered criterion names, sorted."""
    return sorted(_CRITERIA)


def criterion_class(name: str) -> type[Criterion]:
    """The class registered as ``name``; an unknown name raises, listing the known ones."""
    if name not in _CRITERIA:
        raise ValueError(f"unknown criterion {name!r}; known criteria: {', '.join(available_criteria())}")
    return _CRITERIA[name]


def get_criterion(name: str, unit: str = "heads", **options) -> Criterion:
    """A new instance of the criterion ``name`` scoring ``unit``, built with ``options``.

    Unknown names, units the criterion does not score and unknown options raise.
    """
    cls = criterion_class(name)
    if unit not in cls.units:
        raise ValueError(f"criterion {name!r} does not score {unit!r}; it scores: {', '.join(cls.units)}")
    params = inspect.signature(cls).parameters
    try:
        inspect.signature(cls).bind(**options)
    except TypeError:
        accepted = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
        unknown = sorted(set(options) - set(accepted))
        raise ValueError(
            f"criterion {name!r} does not accept option(s) {unknown or sorted(options)}; "
            f"its options: {', '.join(accepted) or 'none'}"
        ) from None
    criterion = cls(**options)
    criterion.unit = unit
    return criterion


from sinv_prune.scoring.criteria import activation, entropy, layers, magnitude, random, sinv, taylor  # noqa: E402,F401  (registration)
from sinv_prune.scoring.criteria.activation import ActivationCriterion  # noqa: E402
from sinv_prune.scoring.criteria.entropy import EntropyCriterion  # noqa: E402
from sinv_prune.scoring.criteria.layers import BlockInfluenceCriterion, SinvDepthCriterion  # noqa: E402
from sinv_prune.scoring.criteria.magnitude import MagnitudeCriterion  # noqa: E402
from sinv_prune.scoring.criteria.random import RandomCriterion  # noqa: E402
from sinv_prune.scoring.criteria.sinv import SinvEarlyCriterion, SinvGaugeCriterion, SinvStaticCriterion  # noqa: E402
from sinv_prune.scoring.criteria.taylor import TaylorCriterion  # noqa: E402

__all__ = [
    "ActivationCriterion",
    "BlockInfluenceCriterion",
    "Criterion",
    "EntropyCriterion",
    "MagnitudeCriterion",
    "RandomCriterion",
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
