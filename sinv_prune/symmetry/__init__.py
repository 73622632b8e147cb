"""The second paper: symmetry-breaking biases, the ECD optimizer, the b_Q alignment analysis.

``ClosureTrainer`` and the alignment functions are imported on first use (they pull in
``transformers.Trainer`` and matplotlib).
"""

from __future__ import annotations

import importlib

from sinv_prune.symmetry.biases import (
    DEFAULT_B_Q,
    DEFAULT_B_V,
    BiasDistribution,
    SymmetryBreakingConfig,
    SymmetryBreakingHandle,
    add_symmetry_breaking,
    get_symmetry_breaking,
    get_symmetry_config,
    restore_symmetry_breaking,
)
from sinv_prune.symmetry.ecd import ECD
from sinv_prune.symmetry.optimizers import (
    build_optimizer,
    optimizer_names,
    optimizer_state_bytes,
    optimizer_state_bytes_per_param,
)

_LAZY = {
    "ClosureTrainer": "sinv_prune.symmetry.trainer",
    "alignment_table": "sinv_prune.symmetry.alignment",
    "plot_alignment": "sinv_prune.symmetry.alignment",
    "key_cosines": "sinv_prune.symmetry.alignment",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_B_Q",
    "DEFAULT_B_V",
    "ECD",
    "BiasDistribution",
    "ClosureTrainer",
    "SymmetryBreakingConfig",
    "SymmetryBreakingHandle",
    "add_symmetry_breaking",
    "alignment_table",
    "build_optimizer",
    "get_symmetry_breaking",
    "get_symmetry_config",
    "key_cosines",
    "optimizer_names",
    "optimizer_state_bytes",
    "optimizer_state_bytes_per_param",
    "plot_alignment",
    "restore_symmetry_breaking",
]
