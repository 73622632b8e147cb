"""The convergence trace: JSON lines, one record of measures per tracking event.

Each measurement line is ``{"step": int, "epoch": float | None, **head_measures(model)}``,
so it carries ``"C_Q"`` (per layer, per query head) and the other measures (a model with experts
also ``"C_FF_experts"``, per layer per routed expert, which ``sinv_early`` reads for experts). Lines
with an ``"event"`` key are notes (the stopping rule fired, or never did).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sinv_prune import strict_json


def append_trace(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line and flush it to disk, so an interrupted run keeps its trace.

    A NaN measure (non-finite weights) is written as ``null``, which the readers skip.
    """
    with open(path, "a", encoding="utf-8") as f:
        f.write(strict_json.dumps(strict_json.null_non_finite(record)[0]) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_trace(path: str | os.PathLike) -> list[dict]:
    """Every line of a trace file, in order (a torn last line is ignored)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return out


def measurements(trace: list[dict]) -> list[dict]:
    """The measurement lines of a trace (those holding ``C_Q``), in order."""
    return [r for r in trace if "C_Q" in r]
