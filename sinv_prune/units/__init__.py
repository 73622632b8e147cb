"""Prunable units, one module each, registered by name: ``heads``, ``mlp`` (channels), ``experts``, ``layers``.

A new unit is one more module: subclass :class:`Unit`, register an instance with
:func:`register_unit` (see docs/design-notes.md, "Adding a unit").
"""

# Registration order is cut order (attention before the MLP and its experts); whole layers go first anyway.
from sinv_prune.units import heads, mlp  # noqa: F401  (registration)

from sinv_prune.units import experts, layers  # noqa: F401  # isort: skip
from sinv_prune.units.base import Unit
from sinv_prune.units.registry import get_unit, register_unit, unit_names, units, unregister_unit

__all__ = ["Unit", "get_unit", "register_unit", "unit_names", "units", "unregister_unit"]
