"""The optimizers compared in the symmetry-breaking paper, by name, and their state memory.

``"adamw"`` and ``"sgd"`` (with momentum) are torch's; ``"ecd"`` is
:class:`sinv_prune.symmetry.ECD`; ``"soap"`` is ``pytorch_optimizer.SOAP`` (Vyas et al. 2024,
"SOAP: Improving and Stabilizing Shampoo using Adam"), from the ``pytorch-optimizer`` package.
"""

from __future__ import annotations

import inspect
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


def _key(name: str) -> str:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in OPTIMIZER_DEFAULTS:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(optimizer_names())}")
    return key


def optimizer_class(name: str) -> type[Optimizer]:
    """The class behind an optimizer name (``"soap"`` imports ``pytorch_optimizer``)."""
    key = _key(name)
    if key == "adamw":
        return torch.optim.AdamW
    if key == "sgd":
        return torch.optim.SGD
    if key == "ecd":
        return ECD
    try:
        from pytorch_optimizer import SOAP
    except ImportError as err:  # pragma: no cover - the package is a dependency
        raise ImportError("the 'soap' optimizer needs the pytorch-optimizer package") from err
    return SOAP


def optimizer_arg_names(name: str) -> list[str]:
    """The keyword arguments the optimizer's constructor names (``params`` and ``**kwargs`` excluded)."""
    signature = inspect.signature(optimizer_class(name).__init__)
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return sorted(n for n, p in signature.parameters.items() if n not in ("self", "params") and p.kind not in skip)


def check_optimizer_args(name: str, args: Iterable[str]) -> None:
    """``ValueError`` naming every argument the optimizer does not take (SOAP would swallow them)."""
    accepted = optimizer_arg_names(name)
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for optimizer "
            f"{_key(name)!r}; it takes {', '.join(accepted)}"
        )


def build_optimizer(name: str, params: Iterable, **kwargs) -> Optimizer:
    """An optimizer by name: ``"adamw"``, ``"sgd"`` (momentum 0.9 by default), ``"ecd"`` or ``"soap"``.

    ``params`` and ``kwargs`` go to the optimizer's constructor as usual; an argument it does not
    take is a ``ValueError``.
    """
    key = _key(name)
    check_optimizer_args(key, kwargs)
    return optimizer_class(key)(params, **{**OPTIMIZER_DEFAULTS[key], **kwargs})


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
