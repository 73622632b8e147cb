"""Prunable units, one folder each (the unit, its selection, gates, cuts), registered by name: ``heads``,
``mlp`` (channels), ``experts``, ``layers``. The contract and registry (:mod:`sinv_prune.surgery.unit`) are
re-exported here; a new unit is one more folder (docs/design-notes.md, "Adding a unit").
"""

# Registration order is cut order (attention before the MLP and its experts); whole layers go first anyway.
from sinv_prune.units import heads, mlp  # noqa: F401  (registration)

from sinv_prune.units import experts, layers  # noqa: F401  # isort: skip
from sinv_prune.surgery.unit import Unit, get_unit, register_unit, unit_names, units, unregister_unit

__all__ = ["Unit", "get_unit", "register_unit", "unit_names", "units", "unregister_unit"]
