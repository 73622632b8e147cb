"""The unit registry: name -> :class:`~sinv_prune.units.base.Unit` instance.

Its own module so that the built-in units (``heads.py``, ``mlp.py``, ``layers.py``) register
through it while the package's ``__init__`` imports them: the imports run one way.
"""

from __future__ import annotations

import re

from sinv_prune.units.base import Unit

_UNITS: dict[str, Unit] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_unit(unit: Unit) -> Unit:
    """Add ``unit`` under ``unit.name`` (lower snake case); refuses a taken name. Returns ``unit``."""
    if not isinstance(unit, Unit):
        raise TypeError(f"register_unit takes a Unit instance, got {type(unit).__name__}")
    name = getattr(unit, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"unit name must be lower snake case, got {name!r}")
    if name in _UNITS:
        raise ValueError(f"unit {name!r} is already registered ({type(_UNITS[name]).__name__})")
    _UNITS[name] = unit
    return unit


def unregister_unit(name: str) -> None:
    """Remove a unit :func:`register_unit` added; an unknown name raises."""
    if _UNITS.pop(name, None) is None:
        raise ValueError(f"unit {name!r} is not registered")


def unit_names() -> tuple[str, ...]:
    """The registered units' names for messages and schemas: per-layer units in registration order, then
    whole-layer ones (``heads``, ``mlp``, ..., ``layers``)."""
    return tuple(sorted(_UNITS, key=lambda name: _UNITS[name].whole_layers))


def units() -> list[Unit]:
    """The registered units, whole-layer units first (they are selected and cut first)."""
    return sorted(_UNITS.values(), key=lambda u: not u.whole_layers)


def get_unit(name: str) -> Unit:
    """The unit registered as ``name``; an unknown name raises a one-line ``ValueError`` listing the known."""
    unit = _UNITS.get(name) if isinstance(name, str) else None
    if unit is None:
        raise ValueError(f"unknown unit {name!r}; choose one of {', '.join(unit_names())}")
    return unit
