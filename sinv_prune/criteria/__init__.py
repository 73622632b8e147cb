"""Head criteria: a registry from name to :class:`Criterion` class.

Built in: ``random``, ``magnitude``, ``sinv_static``, ``sinv_gauge``, ``sinv_early``,
``taylor``, ``entropy``, ``activation``. Users add their own with the decorator::

    @register_criterion("my_score")
    class MyScore(Criterion):
        def scores(self, model):
            ...

and name it in a recipe (options are the class's constructor keywords)::

    prune:
      criterion: my_score
      options: {}
"""

from __future__ import annotations

import inspect
import re

from sinv_prune.criteria.base import Criterion, Scores, TraceLike

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


def get_criterion(name: str, **options) -> Criterion:
    """A new instance of the criterion ``name`` built with ``options``; unknown names and options raise."""
    cls = criterion_class(name)
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
    return cls(**options)


from sinv_prune.criteria import activation, entropy, magnitude, random, sinv, taylor  # noqa: E402,F401  (registration)
from sinv_prune.criteria.activation import ActivationCriterion  # noqa: E402
from sinv_prune.criteria.entropy import EntropyCriterion  # noqa: E402
from sinv_prune.criteria.magnitude import MagnitudeCriterion  # noqa: E402
from sinv_prune.criteria.random import RandomCriterion  # noqa: E402
from sinv_prune.criteria.sinv import SinvEarlyCriterion, SinvGaugeCriterion, SinvStaticCriterion  # noqa: E402
from sinv_prune.criteria.taylor import TaylorCriterion  # noqa: E402

__all__ = [
    "ActivationCriterion",
    "Criterion",
    "EntropyCriterion",
    "MagnitudeCriterion",
    "RandomCriterion",
    "Scores",
    "SinvEarlyCriterion",
    "SinvGaugeCriterion",
    "SinvStaticCriterion",
    "TaylorCriterion",
    "TraceLike",
    "available_criteria",
    "criterion_class",
    "get_criterion",
    "register_criterion",
]
