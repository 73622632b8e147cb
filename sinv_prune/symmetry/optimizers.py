"""The optimizers compared in the symmetry-breaking paper, by name, and their state memory.

``"adamw"`` and ``"sgd"`` (with momentum) are torch's; ``"ecd"`` is
:class:`sinv_prune.symmetry.ECD`; ``"soap"`` is ``pytorch_optimizer.SOAP`` (Vyas et al. 2024,
"SOAP: Improving and Stabilizing Shampoo using Adam"), from the ``pytorch-optimizer`` package.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.optim import Optimizer

from sinv_prune.symmetry.ecd import ECD

#: Defaults applied before the caller's keyword arguments.
OPTIMIZER_DEFAULTS: dict[str, dict] = {
    "adamw": {"lr": 1e-3},
    "sgd": {"lr": 1e-2, "momentum": 0.9},
    "ecd": {},  # ECD's own: lr=1, eta=100, F0=2, nu=0
    "soap": {},  # pytorch_optimizer's: lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=10
}
_ALIASES = {"adam": "adamw", "sgdm": "sgd"}


def optimizer_names() -> list[str]:
    return sorted(OPTIMIZER_DEFAULTS)


def build_optimizer(name: str, params: Iterable, **kwargs) -> Optimizer:
    """An optimizer by name: ``"adamw"``, ``"sgd"`` (momentum 0.9 by default), ``"ecd"`` or ``"soap"``.

    ``params`` and ``kwargs`` go to the optimizer's constructor as usual.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in OPTIMIZER_DEFAULTS:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(optimizer_names())}")
    kwargs = {**OPTIMIZER_DEFAULTS[key], **kwargs}
    if key == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    if key == "sgd":
        return torch.optim.SGD(params, **kwargs)
    if key == "ecd":
        return ECD(params, **kwargs)
    try:
        from pytorch_optimizer import SOAP
    except ImportError as err:  # pragma: no cover - the package is a dependency
        raise ImportError("the 'soap' optimizer needs the pytorch-optimizer package") from err
    return SOAP(params, **kwargs)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes held in ``optimizer.state`` (every tensor, nested in dicts, lists and tuples)."""
    seen: set[int] = set()

    def size(obj) -> int:
        if isinstance(obj, torch.Tensor):
            key = id(obj)
            if key in seen:
                return 0
            seen.add(key)
            return obj.numel() * obj.element_size()
        if isinstance(obj, Mapping):
            return sum(size(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(size(v) for v in obj)
        return 0

    return sum(size(state) for state in optimizer.state.values())


def optimizer_state_bytes_per_param(optimizer: Optimizer) -> float:
    """Optimizer state memory per parameter entry, in bytes (call it after a step: state is lazy).

    The parameters themselves are not counted: float32 AdamW reports about 8 (two moments),
    SGD with momentum and ECD about 4 (one tensor).
    """
    count = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    return optimizer_state_bytes(optimizer) / count if count else 0.0
