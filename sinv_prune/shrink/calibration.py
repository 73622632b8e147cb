"""Calibration text for ``shrink``: a text file, a directory of them, a ``datasets`` id, or token ids.

The text is joined line by line, tokenized once (:func:`~sinv_prune.data.token_ids`) and cut
into consecutive sequences of ``length`` tokens; only as much text as ``sequences x length`` tokens
need is read (a Hub dataset is streamed).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

#: Characters read per token wanted (English BPE runs at 4-5 per token; the surplus is cut off).
CHARS_PER_TOKEN = 8


def calibration_sequences(source, tokenizer=None, *, sequences: int = 64, length: int = 512) -> list[torch.Tensor]:
    """``sequences`` 1-D tensors of ``length`` token ids from ``source``.

    ``source``: a path to a ``.txt`` file or a directory of them (read in name order), a ``datasets``
    id (``name``, ``name:config`` or ``name:config:split``; the ``text`` column, streamed), or an iterable of
    batches (dicts with ``input_ids``) or of id tensors, whose rows are taken as they are. Too little text
    is a one-line ``ValueError`` naming how many tokens it held.
    """
    if sequences < 2 or length < 2:
        raise ValueError(f"calibration needs at least 2 sequences of at least 2 tokens, got {sequences} x {length}")
    if isinstance(source, (str, os.PathLike)):
        if tokenizer is None:
            raise ValueError("calibration text needs a tokenizer (pass tokenizer=, or give token ids)")
        from sinv_prune.data import token_ids

        ids = token_ids(list(_lines(source, sequences * length * CHARS_PER_TOKEN)), tokenizer)
        if ids.numel() < sequences * length:
            raise ValueError(
                f"calibration {source}: {ids.numel():,} tokens, fewer than the {sequences} x {length} asked for"
            )
        return list(ids[: sequences * length].view(sequences, length))
    rows = [r for batch in source for r in _rows(batch)]
    if len(rows) < 2:
        raise ValueError(f"calibration holds {len(rows)} sequence(s); shrink needs at least 2 (one is held out)")
    return rows


def _rows(batch) -> list[torch.Tensor]:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"calibration batches must be dicts with an input_ids tensor or id tensors, got {type(ids)}")
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    ids = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids[None]
    if mask is not None:
        return [r[m.bool()] for r, m in zip(ids, mask.reshape(ids.shape), strict=True)]
    return list(ids)


def _lines(source, chars: int) -> Iterator[str]:
    """Lines of ``source`` until about ``chars`` characters have been read."""
    read = 0
    for line in _all_lines(source):
        yield line
        read += len(line) + 1
        if read >= chars:
            return


def _all_lines(source) -> Iterable[str]:
    path = Path(source)
    if path.is_file():
        yield from path.read_text(encoding="utf-8").splitlines()
        return
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".text", ".md"))
        if not files:
            raise ValueError(f"calibration directory {source} holds no .txt files")
        for f in files:
            yield from f.read_text(encoding="utf-8").splitlines()
        return
    text = str(source)
    if os.path.isabs(text) or text.startswith(".") or text.count("/") > 1:
        raise ValueError(f"calibration {source}: no such file or directory")
    import datasets

    name, config, split = [*text.split(":"), None, None][:3]
    try:
        stream = datasets.load_dataset(name, config, split=split or "train", streaming=True)
    except Exception as err:  # noqa: BLE001  (the Hub or a loader script: any failure is the user's input)
        raise ValueError(f"calibration {source}: cannot load it as a file, directory or dataset ({err})") from None
    for row in stream:
        if "text" not in row:
            raise ValueError(f"calibration dataset {source} has no 'text' column (columns: {', '.join(row)})")
        yield from str(row["text"]).splitlines()
