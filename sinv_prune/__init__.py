"""sinv_prune: find and physically remove attention heads (and MLP channels, layers) from transformers models."""

from sinv_prune.arch import get_adapter, register_adapter, supported_model_types
from sinv_prune.deploy import GGUFExport, export_gguf
from sinv_prune.hub.push import push_pruned
from sinv_prune.pipeline.tracking import ConvergenceCallback, HeadFreezer, stop_rule, track
from sinv_prune.scoring.criteria import Criterion, available_criteria, get_criterion, register_criterion
from sinv_prune.scoring.diagnostics import plot_trace, summarize_trace, time_to_threshold
from sinv_prune.scoring.measures import head_measures
from sinv_prune.scoring.pruner import HeadPruner, Part, Pruner
from sinv_prune.shrink import ShrinkResult, shrink
from sinv_prune.surgery.checkpoint import from_pretrained
from sinv_prune.surgery.removal import PruneSummary, count_parameters, prune, prune_heads
from sinv_prune.symmetry import ECD, add_symmetry_breaking, build_optimizer, restore_symmetry_breaking
from sinv_prune.units import Unit, get_unit, register_unit, unit_names
from sinv_prune.units.heads.gates import head_gates
from sinv_prune.units.heads.selection import select_heads
from sinv_prune.units.layers import select_layers
from sinv_prune.units.mlp.gates import channel_gates
from sinv_prune.units.mlp.selection import select_channels
from sinv_prune.version import __version__

__all__ = [
    "__version__",
    "add_symmetry_breaking",
    "available_criteria",
    "build_optimizer",
    "channel_gates",
    "ConvergenceCallback",
    "count_parameters",
    "Criterion",
    "ECD",
    "export_gguf",
    "GGUFExport",
    "from_pretrained",
    "get_adapter",
    "get_criterion",
    "get_unit",
    "head_gates",
    "head_measures",
    "HeadFreezer",
    "HeadPruner",
    "Part",
    "plot_trace",
    "prune",
    "prune_heads",
    "Pruner",
    "push_pruned",
    "PruneSummary",
    "register_adapter",
    "register_criterion",
    "register_unit",
    "restore_symmetry_breaking",
    "select_channels",
    "select_heads",
    "select_layers",
    "shrink",
    "ShrinkResult",
    "stop_rule",
    "summarize_trace",
    "supported_model_types",
    "time_to_threshold",
    "track",
    "Unit",
    "unit_names",
]
