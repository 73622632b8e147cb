"""Per-layer tensors held off the compute device: in host memory, or in files on disk.

Layer-wise calibration (:mod:`~sinv_prune.surgery.layerwise`) measures one block at a time; what a
block's measurement leaves for later (shrink's Gram and cross matrices, say) waits here, so the
compute device holds one layer's worth at a time. :meth:`Store.get` brings one key's tensors to the
device for a solve; they are freed when the caller drops them. ``where="disk"`` writes each key to a
safetensors file in a temporary directory that :meth:`Store.close` (or the store's collection, or the
interpreter's exit) removes.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

__all__ = ["Store"]

WHERE = ("cpu", "disk")


class Store:
    """Tensors per key (a string), each key a dict ``{name: tensor}``, held on the host (``where="cpu"``) or on
    disk (``where="disk"``, safetensors files under ``directory`` or a new temporary directory)."""

    def __init__(self, where: str = "cpu", directory: str | Path | None = None):
        if where not in WHERE:
            raise ValueError(f"store where={where!r}: expected one of {', '.join(WHERE)}")
        self.where = where
        self._held: dict[str, dict[str, torch.Tensor]] = {}
        self._files: dict[str, Path] = {}
        self._bytes: dict[str, int] = {}
        self.directory: Path | None = None
        self._cleanup = None
        self._closed = False
        if where == "disk":
            self.directory = Path(tempfile.mkdtemp(prefix="sinv-prune-store-", dir=directory))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)

    def put(self, key: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """Hold ``tensors`` under ``key`` (replacing what it held), copied to the host (cast to ``dtype`` if given)."""
        if self.closed:
            raise ValueError("the store is closed")
        host = {name: _host(t, dtype) for name, t in tensors.items()}
        self._bytes[key] = sum(t.numel() * t.element_size() for t in host.values())
        if self.where == "cpu":
            self._held[key] = host
            return
        from safetensors.torch import save_file

        path = self._files.get(key) or self.directory / f"{len(self._files)}.safetensors"
        save_file(host, str(path))
        self._files[key] = path

    def get(self, key: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict:
        """``key``'s tensors on ``device`` (default: the host), cast to ``dtype`` where given (floating ones only)."""
        if key not in self:
            raise KeyError(f"the store holds nothing under {key!r}")
        if self.where == "cpu":
            tensors = self._held[key]
        else:
            from safetensors.torch import load_file

            tensors = load_file(str(self._files[key]))
        device = torch.device(device) if device is not None else torch.device("cpu")
        return {name: _cast(t, device, dtype) for name, t in tensors.items()}

    def drop(self, key: str) -> None:
        """Forget ``key`` (and delete its file)."""
        self._held.pop(key, None)
        self._bytes.pop(key, None)
        path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return list(self._bytes)

    def __contains__(self, key: object) -> bool:
        return key in self._bytes

    def __iter__(self) -> Iterator[str]:
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
