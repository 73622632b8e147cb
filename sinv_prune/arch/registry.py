"""The adapter registry: ``config.model_type`` -> adapter class.

Its own module so that the adapters (``bert.py``, ``gpt2.py``, ``llama.py``) register through it
while the package's ``__init__`` imports them: the imports run one way.
"""

from __future__ import annotations

from torch import nn

from sinv_prune.arch.base import HeadAdapter

_ADAPTERS: dict[str, type[HeadAdapter]] = {}
#: Families people ask for whose removals would not be exact with what sinv_prune slices today: the reason.
REFUSED = {
    "deepseek_v3": "DeepSeek-V3 is not supported: multi-head latent attention has no per-head Q/K/V to slice, and "
    "its sigmoid router with e_score_correction_bias and group-limited top-k (n_group, topk_group) is not exact "
    "under -inf logits for removed experts",
}


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
    if model_type in REFUSED and model_type not in _ADAPTERS:
        raise ValueError(f"unsupported architecture {model_type!r}: {REFUSED[model_type]}")
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"unsupported architecture {model_type or type(model).__name__!r}: "
            f"sinv_prune supports {', '.join(supported_model_types())}"
        )
    return _ADAPTERS[model_type](model)
