"""One directory per run: atomic writes, finished-stage bookkeeping, resume."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sinv_prune import strict_json
from sinv_prune.filemodes import apply_umask


class RunDirError(ValueError):
    """The output directory cannot be used as asked (exists, or nothing to resume)."""


def write_json(path: Path, data: Any) -> None:
    """Write strict JSON atomically: a temp file in the same directory, then ``os.replace``.

    ``allow_nan=False``: NaN or infinity raise ``ValueError`` instead of writing ``NaN`` /
    ``Infinity``, which strict parsers (``jq``, JavaScript, ``json.loads(parse_constant=...)``) reject;
    callers turn such values into ``null`` with a reason first.
    """
    write_text(path, strict_json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        apply_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Fill a directory atomically: ``write(tmp_dir)``, then rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        apply_umask(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class RunDir:
    """The run directory and its ``state.json`` (which stages and arms have finished)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.state_path = self.root / "state.json"
        self.state: dict[str, Any] = {"finished": [], "arms": {}}

    @classmethod
    def open(cls, root: Path, *, overwrite: bool, resume: bool) -> RunDir:
        run = cls(root)
        if root.exists() and any(root.iterdir()):
            if resume:
                if not run.state_path.exists():
                    raise RunDirError(f"{root} has no state.json to resume from")
                run.state = json.loads(run.state_path.read_text())
                return run
            if not overwrite:
                raise RunDirError(f"{root} exists; pass --overwrite to replace it or --resume to continue it")
            shutil.rmtree(root)
        elif resume:
            raise RunDirError(f"{root} does not exist; nothing to resume")
        root.mkdir(parents=True, exist_ok=True)
        return run

    def done(self, stage: str) -> bool:
        return stage in self.state["finished"]

    def finish(self, stage: str) -> None:
        if stage not in self.state["finished"]:
            self.state["finished"].append(stage)
        self.save()

    def arm(self, label: str) -> dict[str, Any]:
        return self.state["arms"].setdefault(label, {})

    def save(self) -> None:
        write_json(self.state_path, self.state)
