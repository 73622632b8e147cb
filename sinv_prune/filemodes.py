"""File modes for files written through a temporary file: the user's umask, not mkstemp's 0600."""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where ``/proc`` says it (``os.umask`` sets it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give ``path`` (and, for a directory, everything in it) the modes a plain ``open`` would.

    ``tempfile.mkstemp`` / ``mkdtemp`` create 0600 files and 0700 directories, and safetensors writes
    its file through one too; after the rename into place they would stay private to the owner.
    """
    mask = current_umask()
    path = Path(path)
    items = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in items:
        if item.is_symlink():
            continue
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
