"""Offload: keep a model's transformer blocks off the compute device except the one being worked on.

``offload="cpu"`` keeps the blocks' weights in host RAM, ``"disk"`` in files of an offload folder
(memory-mapped, or read in place from the checkpoint's safetensors files); the embeddings, final
norm and output head stay on the compute device. Everything goes through accelerate: a device map
(blocks on ``"cpu"`` / ``"disk"``, the rest on the device), ``dispatch_model`` (or transformers'
``from_pretrained(device_map=..., offload_folder=...)`` when loading), and accelerate's
``AlignDevicesHook``, which brings a block's weights in from its ``weights_map`` before its forward
and drops them (back to the ``meta`` device) after.

Surgery on such a block (:func:`onloaded`, :class:`Turns`): the weights of the block are brought
in through the hook (its ``pre_forward``), the hook stops offloading while the block's turn lasts
(forwards then run on the weights as they are being cut and refitted), and at the end of the turn
every tensor that was replaced or added is written to the hook's ``weights_map``: host RAM maps
get the new tensor on the CPU, disk maps a new safetensors file in the offload folder (the index
entry points to it; the old file is left alone), and the block goes back to ``meta`` with its new
shapes. Later forwards and ``save_pretrained`` (which reads offloaded tensors through the hooks)
see the cut weights. :class:`Ledger` remembers every write so a failed :func:`~sinv_prune.prune`
puts the maps back as they were.

Models the caller already dispatched (``device_map="auto"`` over several GPUs, ``cpu_offload``,
``disk_offload``) keep their hooks; on a CPU-only machine ``offload="cpu"`` has nothing to move
(the blocks are on the CPU already) and leaves the model as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "MODES",
    "Ledger",
    "Turns",
    "apply_offload",
    "check_offload",
    "compute_device",
    "default_device",
    "is_offloaded",
    "mark_offloaded",
    "offload_device_map",
    "offload_load_kwargs",
    "offloaded_reason",
    "onloaded",
    "read_tensors",
]

MODES = ("none", "cpu", "disk")


def check_offload(mode: str, folder: str | os.PathLike | None = None) -> None:
    """Refuse an unknown mode, or a folder given without disk offload, with a one-line ``ValueError``."""
    if mode not in MODES:
        raise ValueError(f"offload must be one of {', '.join(MODES)}, got {mode!r}")
    if folder is not None and mode != "disk":
        raise ValueError(f"an offload folder is only used with offload='disk', not {mode!r}")


def default_device() -> torch.device:
    """The compute device when none is given: the first GPU where there is one, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _map_value(device: torch.device) -> int | str:
    """A device as a device-map value (a GPU by its index, as accelerate writes it)."""
    return device.index or 0 if device.type == "cuda" else str(device)


def offload_device_map(model: nn.Module, mode: str, device: torch.device | str | None = None) -> dict[str, Any]:
    """``{module name: device}``: every transformer block on ``mode`` (``"cpu"`` / ``"disk"``), the rest on ``device``.

    ``model`` may be a skeleton on the ``meta`` device. Modules holding blocks are split down to the
    blocks; one with tensors of its own besides blocks cannot be mapped and is refused.
    """
    from sinv_prune.arch import get_adapter

    device = torch.device(device) if device is not None else default_device()
    blocks = {id(b) for b in get_adapter(model).layers()}
    holders = {id(m) for m in model.modules() if any(id(s) in blocks for s in m.modules())}
    out: dict[str, Any] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        own = [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
        if own:
            raise ValueError(f"cannot offload {type(model).__name__}: {prefix or 'the model'} holds {own[0]} "
                             "next to its transformer blocks")  # fmt: skip
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if id(child) in blocks:
                out[full] = mode
            elif id(child) in holders:
                walk(child, full)
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                out[full] = _map_value(device)

    walk(model, "")
    return out


def is_offloaded(module: nn.Module) -> bool:
    """Whether any tensor under ``module`` is kept by an accelerate hook that offloads it."""
    return any(_offload_hook(m) is not None for m in module.modules())


def _hooks(module: nn.Module) -> list:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", [hook]))  # a SequentialHook holds several


def _offload_hook(module: nn.Module):
    """The module's accelerate hook that offloads its weights (an ``AlignDevicesHook`` with a weights map), or None."""
    return next((h for h in _hooks(module) if getattr(h, "offload", False) and h.weights_map is not None), None)


def compute_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate hook's execution device, else its weights' device."""
    for m in module.modules():
        for h in _hooks(m):
            execution = getattr(h, "execution_device", None)
            if execution is not None:
                return torch.device("cuda", execution) if isinstance(execution, int) else torch.device(execution)
    first = next((t for t in module.parameters() if t.device.type != "meta"), None)
    return first.device if first is not None else torch.device("cpu")


def offloaded_reason(module: nn.Module) -> str | None:
    """Why ``module``'s ``meta`` tensors cannot be brought in (no offload hook at or below it holds them), or None."""
    covered: set[int] = set()
    for m in module.modules():
        hook = _offload_hook(m)
        if hook is None:
            continue
        for name, tensor in _hook_tensors(m, hook):
            if tensor.device.type != "meta" or _has(hook.weights_map, name):
                covered.add(id(tensor))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type == "meta" and id(tensor) not in covered:
            return f"{name} is on the meta device and no accelerate offload hook holds it"
    return None


def _has(weights_map: Mapping, name: str) -> bool:
    """Whether ``weights_map`` holds ``name``, without reading it (a disk map would load it)."""
    from accelerate.utils import OffloadedWeightsLoader

    base, key = _base(weights_map, name)
    if isinstance(base, OffloadedWeightsLoader):
        return key in base.state_dict or key in base.index
    return key in base


def _hook_tensors(module: nn.Module, hook) -> list[tuple[str, torch.Tensor]]:
    from accelerate.utils import named_module_tensors

    return list(named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules,
                                     remove_non_persistent=True))  # fmt: skip


def read_tensors(module: nn.Module, root: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters and buffers by name, with their values: as they are, or, where they are on
    the ``meta`` device, read from the weights map of the offload hook that holds them (at ``module`` or on an
    ancestor under ``root``), one tensor at a time, on the host. Detached; never written back."""
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    out = {name: t.detach() for name, t in own if t.device.type != "meta"}
    missing = [name for name, t in own if t.device.type == "meta"]
    if not missing:
        return out
    for m in root.modules():
        hook = _offload_hook(m)
        if hook is None or not (m is module or hook.place_submodules):
            continue
        path = next((name for name, s in m.named_modules() if s is module), None)
        if path is None:
            continue
        for name in missing:
            key = f"{path}.{name}" if path else name
            if _has(hook.weights_map, key):
                out[name] = hook.weights_map[key].detach()
        missing = [name for name in missing if name not in out]
        if not missing:
            return out
    raise ValueError(f"cannot read {type(module).__name__}.{missing[0]}: it is on the meta device and no "
                     "accelerate offload hook holds it")  # fmt: skip


# -- writing cut weights back -----------------------------------------------------------------


@dataclass
class _Write:
    mapping: MutableMapping
    key: str
    had: bool
    old: Any


@dataclass
class Ledger:
    """Every write to an offload map, so a failed surgery can put the maps back (:meth:`undo`)."""

    writes: list[_Write] = field(default_factory=list)

    def record(self, mapping: MutableMapping, key: str) -> None:
        self.writes.append(_Write(mapping, key, key in mapping, mapping.get(key)))

    def undo(self) -> None:
        for w in reversed(self.writes):
            if w.had:
                w.mapping[w.key] = w.old
            else:
                w.mapping.pop(w.key, None)
        self.writes.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[Ledger]:
        """Record the writes made inside the block in this ledger."""
        token = _LEDGER.set(self)
        try:
            yield self
        finally:
            _LEDGER.reset(token)


_LEDGER: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("sinv_prune_offload_ledger", default=None)


def _record(mapping: MutableMapping, key: str) -> None:
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.record(mapping, key)


def _base(weights_map: Mapping, key: str) -> tuple[Mapping, str]:
    """The map under accelerate's ``PrefixedDataset`` wrappers, and ``key`` as it is named there."""
    from accelerate.utils import PrefixedDataset

    while isinstance(weights_map, PrefixedDataset):
        key, weights_map = weights_map.prefix + key, weights_map.dataset
    return weights_map, key


def _store(weights_map: Mapping, changed: dict[str, torch.Tensor]) -> None:
    """Write ``changed`` (names as the hook sees them) to the hook's ``weights_map``; disk entries to one new file."""
    from accelerate.utils import OffloadedWeightsLoader
    from safetensors.torch import save_file

    to_disk: dict[str, tuple[OffloadedWeightsLoader, str, torch.Tensor]] = {}
    for name, tensor in changed.items():
        base, key = _base(weights_map, name)
        value = tensor.detach().to("cpu").contiguous()
        if isinstance(base, OffloadedWeightsLoader):
            on_disk = key not in base.state_dict and (key in base.index or not base.state_dict)
            if on_disk:
                to_disk[key] = (base, key, value)
                continue
            _record(base.state_dict, key)
            base.state_dict[key] = value
            if key not in base.all_keys:
                base.all_keys.append(key)
        elif isinstance(base, MutableMapping):
            _record(base, key)
            base[key] = value
        else:
            raise ValueError(f"cannot write the cut weight {key} back to an offload map of type {type(base).__name__}")
    by_loader: dict[int, list] = {}
    for entry in to_disk.values():
        by_loader.setdefault(id(entry[0]), []).append(entry)
    for entries in by_loader.values():
        loader = entries[0][0]
        folder = os.path.join(_folder(loader), "sinv_prune_cuts")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{uuid.uuid4().hex}.safetensors")
        save_file({key: value for _, key, value in entries}, path)
        for _, key, value in entries:
            _record(loader.index, key)
            dtype = str(value.dtype).removeprefix("torch.")
            loader.index[key] = {"safetensors_file": path, "weight_name": key, "dtype": dtype}
            if key not in loader.all_keys:
                loader.all_keys.append(key)


def _folder(loader) -> str:
    """Where a disk offload map's new files go: its offload folder, else a fresh temporary one."""
    if loader.save_folder is not None:
        return os.fspath(loader.save_folder)
    if getattr(loader, "sinv_prune_folder", None) is None:
        loader.sinv_prune_folder = tempfile.mkdtemp(prefix="sinv-prune-offload-")
    return loader.sinv_prune_folder


# -- a block's turn ---------------------------------------------------------------------------


@contextlib.contextmanager
def onloaded(module: nn.Module, root: nn.Module | None = None) -> Iterator[nn.Module]:
    """Bring ``module``'s offloaded weights onto its execution device for the block; write back what changed.

    Inside, the hooks do not offload (forwards run on the weights as they are), so weights may be read,
    sliced and replaced freely; on leaving, every tensor replaced or added is written to its hook's
    ``weights_map`` and the weights go back to ``meta``. Hooks at or below ``module`` are found; with
    ``root`` (the model), a hook on an ancestor that holds ``module``'s weights too (its whole module is
    brought in). A module with no offloaded weights is left alone.
    """
    owners = [(m, h) for m in module.modules() if (h := _offload_hook(m)) is not None]
    if root is not None:
        seen = {id(m) for m, _ in owners}
        for m in root.modules():
            h = _offload_hook(m)
            if h is not None and id(m) not in seen and h.place_submodules and any(s is module for s in m.modules()):
                owners.append((m, h))
    if not owners:
        if any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers())):
            raise ValueError(f"cannot bring {type(module).__name__} in: a hook above it offloads its weights; "
                             "offload whole blocks or smaller modules (a device_map down to the blocks)")  # fmt: skip
        yield module
        return
    brought: list[tuple[nn.Module, Any, dict[str, torch.Tensor]]] = []
    try:
        for m, h in owners:
            h.pre_forward(m)
            h.offload = False
            brought.append((m, h, dict(_hook_tensors(m, h))))
        reason = offloaded_reason(module)
        if reason is not None:
            raise ValueError(f"cannot bring {type(module).__name__} in: {reason}")
        yield module
        for m, h, before in brought:
            changed = {name: t for name, t in _hook_tensors(m, h) if t is not before.get(name)}
            if changed:
                _store(h.weights_map, changed)
    finally:
        for m, h, _ in brought:
            h.offload = True
            h.post_forward(m, None)


class Turns:
    """One block onloaded at a time: ``turn(block)`` ends the previous block's turn (writing back) and starts this one.

    Use as ``with Turns() as turn: for block in ...: turn(block); ...``; leaving ends the last turn.
    """

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Turns:
        return self

    def __call__(self, block: nn.Module) -> None:
        self.end()
        stack = contextlib.ExitStack()
        stack.enter_context(onloaded(block))
        self._stack = stack

    def end(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*(exc or (None, None, None)))

    def __exit__(self, *exc) -> None:
        self.end(*exc)


def mark_offloaded(model: nn.Module) -> None:
    """Give a model offloaded by accelerate's ``cpu_offload`` / ``disk_offload`` (which set no ``hf_device_map``)
    the map ``{"": "cpu"}``, so that transformers' ``save_pretrained`` reads its offloaded weights through the hooks.

    ``save_pretrained`` looks for ``"cpu"`` or ``"disk"`` in ``hf_device_map`` to know that some tensors are
    on ``meta`` and must be read from their hook's weights map; without it, it fails on the first one.
    """
    if getattr(model, "hf_device_map", None) is None and is_offloaded(model):
        model.hf_device_map = {"": "cpu"}


# -- offloading a model -----------------------------------------------------------------------


def apply_offload(
    model: nn.Module,
    mode: str = "none",
    device: torch.device | str | None = None,
    folder: str | os.PathLike | None = None,
) -> nn.Module:
    """Offload ``model``'s transformer blocks (``"cpu"`` / ``"disk"``) with accelerate's ``dispatch_model``; in place.

    The embeddings, final norm and head go to ``device`` (default: the first GPU, else the CPU);
    each block stays in host RAM (``cpu``) or is written to ``folder`` (``disk``; default: a new
    temporary folder) and comes to ``device`` for its forward only. A model already under accelerate
    hooks keeps them, and ``offload="cpu"`` with the CPU as the device has nothing to move: both are
    returned as they are. Returns ``model``.
    """
    check_offload(mode, folder)
    if mode == "none" or any(_hooks(m) for m in model.modules()):
        return model
    device = torch.device(device) if device is not None else default_device()
    if mode == "cpu" and device.type == "cpu":
        return model
    from accelerate import dispatch_model

    device_map = offload_device_map(model, mode, device)
    kwargs: dict[str, Any] = {"main_device": _map_value(device)}
    if mode == "cpu":  # the blocks' weights in host RAM, wherever they are now (dispatch_model keeps them in place)
        blocks = tuple(f"{name}." for name, where in device_map.items() if where == "cpu")
        kwargs["state_dict"] = {k: v.to("cpu") for k, v in model.state_dict().items() if k.startswith(blocks)}
    if mode == "disk":
        kwargs["offload_dir"] = _new_folder(folder)
    skip = getattr(model, "_skip_keys_device_placement", None)
    if skip is not None:
        kwargs["skip_keys"] = skip
    return dispatch_model(model, device_map, **kwargs)


def offload_load_kwargs(
    cls: type, config, mode: str, device: torch.device | str | None = None, folder: str | os.PathLike | None = None
) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load a checkpoint with its blocks offloaded (``{}`` for none).

    The device map comes from a skeleton of ``cls`` built on the ``meta`` device (no weights); disk
    offload reads the blocks in place from safetensors checkpoints (else writes them to ``folder``).
    """
    check_offload(mode, folder)
    device = torch.device(device) if device is not None else default_device()
    if mode == "none" or (mode == "cpu" and device.type == "cpu"):
        return {}
    with torch.device("meta"):
        skeleton = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    out: dict[str, Any] = {"device_map": offload_device_map(skeleton, mode, device)}
    if mode == "disk":
        out["offload_folder"] = _new_folder(folder)
    return out


def _new_folder(folder: str | os.PathLike | None) -> str:
    """The offload folder: the one given, else a new temporary one (left for the caller's system to clean)."""
    return os.fspath(folder) if folder is not None else tempfile.mkdtemp(prefix="sinv-prune-offload-")
