"""One row of the ``--dry-run`` table, and the text-size rule rows share.

Its own module so that the stages' row builders (``estimate.py``, ``tasks.py``) share it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

# Text characters per token of a subword tokenizer (SmolLM2's on WikiText-2: 4.1).
CHARS_PER_TOKEN = 4.0


@dataclass
class Row:
    """A stage (or one arm's part of it), its estimated seconds, and what they count."""

    stage: str
    seconds: float
    what: str
