"""Architecture adapters: a registry from ``config.model_type`` to adapter class.

Adding an architecture means adding one module here that defines a
:class:`~sinv_prune.arch.base.HeadAdapter` subclass decorated with
:func:`register_adapter`, and importing it at the bottom of this file.
"""

from __future__ import annotations

from torch import nn

from sinv_prune.arch.base import HeadAdapter, HeadLayout, Projections

_ADAPTERS: dict[str, type[HeadAdapter]] = {}


def register_adapter(cls: type[HeadAdapter]) -> type[HeadAdapter]:
    """Class decorator: serve every ``cls.model_types`` with ``cls``; refuses duplicates."""
    for model_type in cls.model_types:
        if model_type in _ADAPTERS:
            raise ValueError(f"model_type {model_type!r} already has adapter {_ADAPTERS[model_type].__name__}")
        _ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(model: nn.Module) -> HeadAdapter:
    """The adapter for ``model``, found from its config; ``ValueError`` if unsupported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"unsupported architecture {model_type or type(model).__name__!r}: "
            f"sinv_prune supports {', '.join(supported_model_types())}"
        )
    return _ADAPTERS[model_type](model)


from sinv_prune.arch import bert, gpt2, llama  # noqa: E402,F401  (registration)

__all__ = ["HeadAdapter", "HeadLayout", "Projections", "get_adapter", "register_adapter", "supported_model_types"]
