"""Architecture adapters: a registry from ``config.model_type`` to adapter class.

Adding an architecture means adding one module here that defines a
:class:`~sinv_prune.arch.base.HeadAdapter` subclass decorated with
:func:`~sinv_prune.arch.registry.register_adapter`, and importing it below.
"""

from __future__ import annotations

from sinv_prune.arch import bert, gpt2, llama, moe  # noqa: F401  (registration)
from sinv_prune.arch.base import HeadAdapter, HeadLayout, Projections
from sinv_prune.arch.registry import get_adapter, register_adapter, supported_model_types

__all__ = ["HeadAdapter", "HeadLayout", "Projections", "get_adapter", "register_adapter", "supported_model_types"]
