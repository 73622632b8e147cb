"""Prunable units, one folder each, registered by name: ``heads``, ``mlp`` (channels), ``experts``, ``layers``.

A unit's folder holds its :class:`Unit` subclass (``__init__.py``) and, where it has them, its selection,
gates and cuts (``selection.py``, ``gates.py``, ``cuts.py``); :mod:`sinv_prune.units.common` what several
share. The contract and the registry are :mod:`sinv_prune.surgery.unit` (the removal iterates over the
registered units), re-exported here. A new unit is one more folder: subclass :class:`Unit`, register an
instance with :func:`register_unit` (see docs/design-notes.md, "Adding a unit").
"""

# Registration order is cut order (attention before the MLP and its experts); whole layers go first anyway.
from sinv_prune.units import heads, mlp  # noqa: F401  (registration)

from sinv_prune.units import experts, layers  # noqa: F401  # isort: skip
from sinv_prune.surgery.unit import Unit, get_unit, register_unit, unit_names, units, unregister_unit

__all__ = ["Unit", "get_unit", "register_unit", "unit_names", "units", "unregister_unit"]
