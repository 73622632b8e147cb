"""sinv_prune: find and physically remove attention heads from transformers models."""

from sinv_prune.arch import get_adapter, register_adapter, supported_model_types
from sinv_prune.checkpoint import from_pretrained
from sinv_prune.gates import head_gates
from sinv_prune.surgery import PruneSummary, count_parameters, prune_heads
from sinv_prune.version import __version__

__all__ = [
    "PruneSummary",
    "__version__",
    "count_parameters",
    "from_pretrained",
    "get_adapter",
    "head_gates",
    "prune_heads",
    "register_adapter",
    "supported_model_types",
]
