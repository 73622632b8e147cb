"""Strict JSON for every file the project writes: ``NaN`` / ``Infinity`` never reach a file.

Python's ``json`` writes non-finite floats as ``NaN`` / ``Infinity`` by default, which is not JSON:
``jq``, JavaScript and most other parsers reject the whole file. :func:`dumps` refuses them
(``allow_nan=False``); :func:`null_non_finite` turns them into ``null`` and says where they were, so
a writer can keep the reason next to the value.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` that raises ``ValueError`` on NaN or infinity instead of writing invalid JSON."""
    return json.dumps(data, allow_nan=False, **kwargs)


def null_non_finite(data: Any, where: str = "") -> tuple[Any, dict[str, str]]:
    """A copy of ``data`` with every NaN / infinite float replaced by ``None``, and what each was.

    The second value maps a dotted path (``arms.0.pruned.perplexity``) to ``"nan"``, ``"inf"`` or
    ``"-inf"``; it is empty when everything was finite.
    """
    found: dict[str, str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return None
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]
        return value

    return walk(data, where), found


def with_null_reasons(data: dict) -> dict:
    """``data`` with non-finite numbers as ``null`` and, if there were any, a ``"non_finite"`` key
    mapping each one's path to what it was (so a reader knows ``null`` is not "not measured")."""
    clean, found = null_non_finite(data)
    if found:
        clean["non_finite"] = {**clean.get("non_finite", {}), **{k: f"was {v}" for k, v in found.items()}}
    return clean
