"""Rebuild a pruned model's shapes from its record: each registered unit slices what it recorded.

Its own module because the units import :mod:`sinv_prune.surgery.shapes` for their cuts; the
checkpoint loader imports this one, which imports the units: the imports run one way.
"""

from __future__ import annotations

from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.record import PruningRecord
from sinv_prune.surgery.unit import units


def apply_record(model: nn.Module, record: PruningRecord) -> None:
    """Slice a freshly built model (original head and MLP sizes, current layer count) to ``record``'s shapes."""
    adapter = get_adapter(model)
    kept_layers = record.kept_layers()
    if adapter.num_layers != len(kept_layers):
        raise ValueError(
            f"the config builds {adapter.num_layers} layers but the pruning record keeps {len(kept_layers)} "
            f"of {record.num_layers}"
        )
    for current, original in enumerate(kept_layers):
        for unit in units():
            unit.rebuild(adapter, current, original, record)
    for unit in units():  # what the forward reads beyond the shapes (the load-balancing loss's expert count)
        unit.state_config(model, adapter, record, False)
