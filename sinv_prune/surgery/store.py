"""A host-side store for tensors a run may need again (rollback copies, plainly pruned weights).

:func:`~sinv_prune.prune` keeps, until it returns, the old weights of every block it cut (to undo a
failure) and, with compensation, the plainly pruned weights of every refitted consumer (to undo the
refits where the held-out loss prefers plain pruning). Both grow with depth. A :class:`Store` takes
them off the compute device: ``where="cpu"`` keeps them in host memory (a tensor already on the CPU
is kept by reference, not copied), ``where="disk"`` writes each entry to a file in a temporary
folder, so host memory stays flat whatever the depth. :meth:`Store.close` deletes the folder.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Hashable, Mapping
from pathlib import Path

import torch

__all__ = ["PLACES", "Store"]

#: Where a :class:`Store` keeps its tensors.
PLACES = ("cpu", "disk")


class Store:
    """Tensors by key, on the host (``"cpu"``) or in files of a temporary folder (``"disk"``).

    ``put(key, {name: tensor})`` keeps a dict of tensors (detached; on the host); ``get(key, device)``
    gives it back on ``device`` (the host when None); ``pop`` gives it back and forgets it.
    """

    def __init__(self, where: str = "cpu", folder: str | Path | None = None):
        if where not in PLACES:
            raise ValueError(f"store: where must be one of {', '.join(map(repr, PLACES))}, got {where!r}")
        self.where = where
        self._held: dict[Hashable, dict[str, torch.Tensor] | Path] = {}
        self._folder = Path(tempfile.mkdtemp(prefix="sinv_prune_store_", dir=folder)) if where == "disk" else None
        self._count = 0

    def put(self, key: Hashable, tensors: Mapping[str, torch.Tensor | None]) -> None:
        """Keep ``tensors`` (None values kept as None) under ``key``, replacing what it held."""
        host = {name: None if t is None else t.detach().to("cpu") for name, t in tensors.items()}
        self._drop(key)
        if self._folder is None:
            self._held[key] = host
            return
        self._count += 1
        path = self._folder / f"{self._count}.pt"
        torch.save({name: None if t is None else _compact(t) for name, t in host.items()}, path)
        self._held[key] = path

    def get(self, key: Hashable, device: torch.device | str | None = None) -> dict[str, torch.Tensor | None]:
        """The tensors kept under ``key``, on ``device`` (the host when None)."""
        if key not in self._held:
            raise KeyError(f"store holds nothing under {key!r}")
        held = self._held[key]
        tensors = torch.load(held, map_location="cpu", weights_only=True) if isinstance(held, Path) else held
        if device is None:
            return dict(tensors)
        return {name: None if t is None else t.to(device) for name, t in tensors.items()}

    def pop(self, key: Hashable, device: torch.device | str | None = None) -> dict[str, torch.Tensor | None]:
        """:meth:`get`, then forget ``key`` (its file is deleted)."""
        tensors = self.get(key, device)
        self._drop(key)
        return tensors

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        """Forget everything and delete the folder (``"disk"``)."""
        self._held.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if isinstance(held, Path):
            held.unlink(missing_ok=True)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` alone: a view of a larger storage is copied, so a file holds only its own bytes."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t
