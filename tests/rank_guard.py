"""``python tests/rank_guard.py RUN_DIR ARGS...``: ``sinv-prune ARGS`` where a process that is not the
main one (``RANK`` != 0) may not write anything under ``RUN_DIR``.

An audit hook (PEP 578) refuses, on the other ranks, every open for writing, ``os.open`` with
write flags, mkdir, rename / replace, remove, rmdir, chmod and ``shutil.rmtree`` of a path in
``RUN_DIR``; the refused write raises ``PermissionError`` naming the rank and the path, and the
launch fails. Without it a non-main rank writing the same files atomically leaves no trace.

One exception: inside a Trainer checkpoint (``.../checkpoints/checkpoint-N/``) every process saves
its own random state (``rng_state_RANK.pth``), as ``transformers.Trainer`` does under any launcher.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod", "shutil.rmtree", "os.truncate"}


def guard(root: Path, rank: str) -> None:
    root = root.resolve()

    def inside(path) -> bool:
        if isinstance(path, int) or path is None:
            return False
        try:
            resolved = Path(os.fsdecode(path)).resolve()
        except (TypeError, ValueError):
            return False
        if resolved != root and root not in resolved.parents:
            return False
        parts = resolved.relative_to(root).parts
        in_checkpoint = any(
            a == "checkpoints" and b.startswith("checkpoint-") for a, b in zip(parts, parts[1:], strict=False)
        )
        return not in_checkpoint

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)
            paths = [path] if writes else []
        elif event in PATH_EVENTS:
            paths = [a for a in args[:2] if isinstance(a, str | bytes | os.PathLike)]
            if event == "os.mkdir" and paths and os.path.isdir(paths[0]):
                paths = []  # makedirs(exist_ok=True) of a directory that is there: no write
        else:
            return
        for path in paths:
            if inside(path):
                raise PermissionError(f"rank {rank} is not the main process but wrote {event} {os.fsdecode(path)}")

    sys.addaudithook(hook)


if __name__ == "__main__":
    run_dir, *cli_args = sys.argv[1:]
    if os.environ.get("RANK", "0") != "0":
        guard(Path(run_dir), os.environ["RANK"])
    from sinv_prune.cli import main

    sys.argv = ["sinv-prune", *cli_args]
    main()
