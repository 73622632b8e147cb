"""The criterion registry: name -> :class:`Criterion` class.

Its own module so that the built-in criteria register through it while the package's ``__init__``
imports them: the imports run one way.
"""

from __future__ import annotations

import inspect
import re

from sinv_prune.scoring.criteria.base import Criterion

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
