"""A model loaded by :func:`sinv_prune.from_pretrained` remembers where its tokenizer is, and saves it with itself.

Without this, ``model.save_pretrained(dir)`` after a GGUF or Hub load writes weights and config only,
and every next step a user takes on ``dir`` (``sinv-prune eval``, ``export``, ``push``) lacks the
tokenizer. The source is a small dict on the model (``sinv_tokenizer_source``); the instance's
``save_pretrained`` (also what ``push_to_hub`` calls) writes the tokenizer after the weights,
unless the directory already has one or this is not the main process.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

from torch import nn

logger = logging.getLogger(__name__)

ATTR = "sinv_tokenizer_source"
#: Files whose presence means a directory holds a tokenizer (as transformers saves one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def tokenizer_source(path: str, gguf_file: str | None = None, **hub_kwargs) -> dict | None:
    """Where the tokenizer of a checkpoint loaded from ``path`` lives, or None when it has none."""
    if gguf_file:
        return {"path": path, "gguf_file": gguf_file}
    if os.path.isdir(path):
        return {"path": path} if has_tokenizer(path) else None
    hub = {k: v for k, v in hub_kwargs.items() if k in ("revision", "subfolder") and v is not None}
    return {"path": path, **hub}  # a Hub id: fetched (or read from the cache) when the model is saved


def remember_tokenizer(model: nn.Module, source: dict | None) -> None:
    """Make ``model.save_pretrained`` also write the tokenizer found at ``source``."""
    if source is None:
        return
    setattr(model, ATTR, source)
    model.save_pretrained = _SaveWithTokenizer(model)


class _SaveWithTokenizer:
    """The instance's ``save_pretrained``: the class's, then the tokenizer.

    It holds the model weakly: a bound method in the model's own ``__dict__`` would be a reference
    cycle, keeping every such model alive until the cyclic collector runs. A ``deepcopy`` of the
    model gets one bound to the copy (``copy`` registers the new model in ``memo`` before its state).
    """

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)

    def __call__(self, save_directory, *args, **kwargs):
        model = self._model()
        if model is None:
            raise ReferenceError("the model this save_pretrained belonged to is gone")
        return _save_with_tokenizer(model, save_directory, *args, **kwargs)

    def __reduce__(self):  # pickle memoizes the model before its state, so this refers back to it
        return (_SaveWithTokenizer, (self._model(),))

    def __deepcopy__(self, memo):
        model = self._model()
        twin = memo.get(id(model)) if model is not None else None
        return _SaveWithTokenizer(twin if twin is not None else model)


def load_source_tokenizer(source: dict):
    """The tokenizer ``source`` names, as saved next to the model."""
    from transformers import AutoTokenizer

    kwargs = {k: v for k, v in source.items() if k != "path"}
    return AutoTokenizer.from_pretrained(source["path"], **kwargs)


def _save_with_tokenizer(self: nn.Module, save_directory, *args, **kwargs):
    out = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    source = getattr(self, ATTR, None)
    target = Path(save_directory)
    if source is None or not kwargs.get("is_main_process", True) or has_tokenizer(target):
        return out
    try:
        load_source_tokenizer(source).save_pretrained(target)
    except (OSError, ValueError) as err:
        logger.warning("saved %s without a tokenizer: loading it from %s failed (%s)", target, source["path"], err)
    return out


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a saved tokenizer."""
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)
