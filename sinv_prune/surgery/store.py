"""Tensors held off the compute device until needed again: in host memory, or in files on disk.

Layer-wise calibration (:mod:`~sinv_prune.surgery.layerwise`) measures one block at a time; what a
block's measurement leaves for later (shrink's Gram and cross matrices, say) waits here, so the
compute device holds one layer's worth at a time. :func:`~sinv_prune.prune` keeps its rollback
copies and the plainly pruned weights of refitted consumers here too, so what it holds beyond the
model does not grow with depth on disk. :meth:`Store.get` brings one key's tensors to the
device for a solve; they are freed when the caller drops them. ``where="disk"`` writes each key to a
safetensors file in a temporary directory that :meth:`Store.close` (or the store's collection, or the
interpreter's exit) removes.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Hashable, Iterator, Mapping
from pathlib import Path

import torch

__all__ = ["PLACES", "Store"]

#: Where a :class:`Store` keeps its tensors.
PLACES = WHERE = ("cpu", "disk")


class Store:
    """Tensors per key, each key a dict ``{name: tensor or None}``, held on the host (``where="cpu"``) or on
    disk (``where="disk"``, safetensors files under ``directory`` or a new temporary directory)."""

    def __init__(self, where: str = "cpu", directory: str | Path | None = None):
        if where not in WHERE:
            raise ValueError(f"store where={where!r}: expected one of {', '.join(WHERE)}")
        self.where = where
        self._held: dict[Hashable, dict[str, torch.Tensor | None]] = {}
        self._files: dict[Hashable, tuple[Path, tuple[str, ...]]] = {}
        self._bytes: dict[Hashable, int] = {}
        self._count = 0
        self.directory: Path | None = None
        self._cleanup = None
        self._closed = False
        if where == "disk":
            self.directory = Path(tempfile.mkdtemp(prefix="sinv-prune-store-", dir=directory))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)

    def put(self, key: Hashable, tensors: Mapping[str, torch.Tensor | None], dtype: torch.dtype | None = None) -> None:
        """Hold ``tensors`` under ``key`` (replacing what it held), copied to the host (cast to ``dtype`` if given).

        ``None`` values are kept as ``None`` (a consumer without a bias, say).
        """
        if self.closed:
            raise ValueError("the store is closed")
        host = {name: None if t is None else _host(t, dtype) for name, t in tensors.items()}
        self.drop(key)
        self._bytes[key] = sum(t.numel() * t.element_size() for t in host.values() if t is not None)
        if self.where == "cpu":
            self._held[key] = host
            return
        from safetensors.torch import save_file

        self._count += 1
        path = self.directory / f"{self._count}.safetensors"
        save_file({name: t for name, t in host.items() if t is not None}, str(path))
        self._files[key] = (path, tuple(name for name, t in host.items() if t is None))

    def get(self, key: Hashable, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict:
        """``key``'s tensors on ``device`` (default: the host), cast to ``dtype`` where given (floating ones only)."""
        if key not in self:
            raise KeyError(f"the store holds nothing under {key!r}")
        if self.where == "cpu":
            tensors = self._held[key]
        else:
            from safetensors.torch import load_file

            path, empty = self._files[key]
            tensors = load_file(str(path)) | dict.fromkeys(empty)
        device = torch.device(device) if device is not None else torch.device("cpu")
        return {name: None if t is None else _cast(t, device, dtype) for name, t in tensors.items()}

    def pop(self, key: Hashable, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict:
        """:meth:`get`, then forget ``key`` (its file is deleted)."""
        tensors = self.get(key, device, dtype)
        self.drop(key)
        return tensors

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (and delete its file)."""
        self._held.pop(key, None)
        self._bytes.pop(key, None)
        held = self._files.pop(key, None)
        if held is not None:
            held[0].unlink(missing_ok=True)

    def keys(self) -> list[Hashable]:
        return list(self._bytes)

    def __contains__(self, key: object) -> bool:
        return key in self._bytes

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._bytes)

    @property
    def nbytes(self) -> int:
        """Bytes held, in host memory or on disk."""
        return sum(self._bytes.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Forget everything; a disk store removes its directory."""
        self._held.clear()
        self._files.clear()
        self._bytes.clear()
        self._closed = True
        if self._cleanup is not None:
            self._cleanup()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    out = t.to("cpu", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype).contiguous()
    return out.clone() if out.data_ptr() == t.data_ptr() else out  # a copy: the caller may change its own


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device)
