"""Kept for checkpoints saved by sinv_prune 0.1.0: their shipped ``modeling_sinv_prune.py`` imports this name.

The checkpoint code lives in :mod:`sinv_prune.surgery.checkpoint`.
"""

from sinv_prune.surgery.checkpoint import class_by_name

__all__ = ["class_by_name"]
