"""The export's own errors: what the user should read as one line (nothing was written), apart from bugs.

Both subclass ``ValueError`` so callers that caught ``ValueError`` keep working; the command line and
the recipe's export stage catch :class:`ExportError` only, so any other exception keeps its traceback.
"""

from __future__ import annotations


class ExportError(ValueError):
    """An export that was refused or whose file failed its round trip; nothing was left at the output path."""


class ExportRefused(ExportError):
    """No llama.cpp architecture computes what the model computes, or an argument is wrong."""


class RoundTripFailed(ExportError):
    """llama.cpp's logits for the written file differ from transformers' by more than the rule allows."""
