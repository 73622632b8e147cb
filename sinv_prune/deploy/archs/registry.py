"""The llama.cpp architectures the exporter writes, one registered class each (as llama.cpp's converter does)."""

from __future__ import annotations

from sinv_prune.deploy.archs.base import GGUFArch

_ARCHS: dict[str, GGUFArch] = {}


def register(cls: type[GGUFArch]) -> type[GGUFArch]:
    """Class decorator: add an architecture (one per llama.cpp name)."""
    if cls.name in _ARCHS:
        raise ValueError(f"llama.cpp architecture {cls.name!r} is registered already")
    _ARCHS[cls.name] = cls()
    return cls


def get_arch(name: str) -> GGUFArch:
    """The registered architecture called ``name`` by llama.cpp."""
    try:
        return _ARCHS[name]
    except KeyError:
        raise KeyError(f"no llama.cpp architecture {name!r}; known: {', '.join(_ARCHS)}") from None


def native_arch(family: str) -> GGUFArch | None:
    """The architecture llama.cpp has of its own for a transformers ``model_type``, if the exporter writes it."""
    return next((a for a in _ARCHS.values() if family in a.families), None)


def candidates(family: str) -> list[GGUFArch]:
    """Architectures to try for ``family``, in order: its own, then the general ones that can take it."""
    from sinv_prune.deploy.archs.moe import MOE_FAMILIES

    own = native_arch(family)
    if own is None:
        return []
    moe = family in MOE_FAMILIES  # only an architecture that reads experts can take them
    general = [a for a in _ARCHS.values() if a is not own and own.llama_family and a.fallback and a.experts >= moe]
    return [own] + sorted(general, key=lambda a: a.per_layer)  # one shape for all layers before per-layer arrays


def families() -> list[str]:
    """Every transformers ``model_type`` some registered architecture is native for."""
    return [f for a in _ARCHS.values() for f in a.families]
