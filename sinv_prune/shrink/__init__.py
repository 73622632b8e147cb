"""Shrink a model to a size in one call: a joint search over layers, heads and MLP channels (:mod:`.search`)."""

from sinv_prune.shrink.search import ShrinkResult, shrink

__all__ = ["ShrinkResult", "shrink"]
