"""One context manager for "this logger at that level for a while" (restored however the block ends)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def log_level(name: str, level: int) -> Iterator[logging.Logger]:
    """Set logger ``name`` to ``level`` inside the block, then back to what it was."""
    log = logging.getLogger(name)
    before = log.level
    log.setLevel(level)
    try:
        yield log
    finally:
        log.setLevel(before)
