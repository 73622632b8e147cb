"""The GGUF files that go to the Hub with a pushed checkpoint, described from their own headers.

A GGUF file belongs to the checkpoint in ``model_dir`` when it lies inside that directory
(``sinv-prune shrink --gguf`` writes ``OUT/model.gguf``; a run's ``export.gguf`` writes
``base/model.gguf``), or when the run's ``export.gguf`` wrote it of this very model:
``arms/NAME/model.gguf``, beside the arm's final model (fine-tuned, else pruned). A file exported
from an arm's fine-tuned model never goes with its pruned one.

Type, llama.cpp architecture and vocabulary are read from each file's header (``general.file_type``,
``general.architecture``, ``tokenizer.ggml.model``), so a file is described as it is, whoever wrote it
(:func:`sinv_prune.deploy.gguf_header.header_fields`: a few fields, not the whole header).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf

from sinv_prune.deploy.gguf_header import header_fields
from sinv_prune.hub.model_card import find_arm


@dataclass(frozen=True)
class GGUFFile:
    """One GGUF file to upload: where it is, its path in the repo, and what it holds."""

    path: Path
    name: str
    type: str
    arch: str
    size_bytes: int
    vocab: bool


def gguf_files(model_dir: str | os.PathLike, results: dict | None = None, arm: str | None = None) -> list[GGUFFile]:
    """The GGUF files of the checkpoint in ``model_dir``: those inside it, then the one the run's
    ``export.gguf`` wrote of it (``results`` and ``arm`` as :func:`sinv_prune.hub.push.push_pruned` takes them).
    The exported file goes to the repo's top level under its own name, unless a file inside has that name."""
    model_dir = Path(model_dir)
    inside = sorted(p for p in model_dir.rglob("*.gguf") if p.is_file() and not _hidden(p, model_dir))
    out = [describe(p, p.relative_to(model_dir).as_posix()) for p in inside]
    exported = _exported_file(model_dir, results, arm)
    if exported is not None and exported.name not in {f.name for f in out}:
        out.append(describe(exported, exported.name))
    return out


def describe(path: str | os.PathLike, name: str) -> GGUFFile:
    """``path``'s type, llama.cpp architecture and whether it has a vocabulary, read from its header."""
    path = Path(path)
    keys = (gguf.Keys.General.FILE_TYPE, gguf.Keys.General.ARCHITECTURE, gguf.Keys.Tokenizer.MODEL)
    fields = header_fields(path, set(keys))
    file_type, arch, tokenizer = (fields.get(k) for k in keys)
    return GGUFFile(
        path=path,
        name=name,
        type=file_type_name(int(file_type)) if file_type is not None else "unknown type",
        arch=str(arch or "unknown"),
        size_bytes=path.stat().st_size,
        vocab=tokenizer not in (None, "none"),
    )


def file_type_name(value: int) -> str:
    """llama.cpp's ``general.file_type`` as the type names the export takes: ``7`` -> ``"q8_0"``."""
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def _exported_file(model_dir: Path, results: dict | None, arm: str | None) -> Path | None:
    """The run's ``export.gguf`` file of this model: the arm's entry, when ``model_dir`` is the arm's final model."""
    row = find_arm(results, arm)
    entry = ((results or {}).get("gguf") or {}).get((row or {}).get("name"))
    if not row or not entry or not row.get("model_dir") or not entry.get("path"):
        return None
    final = Path(row["model_dir"])  # relative to the run directory, as is the file's path
    here = model_dir.resolve()
    if here.parts[-len(final.parts) :] != final.parts:
        return None  # another model of the arm (its pruned one when it was fine-tuned)
    file = here.parents[len(final.parts) - 1] / entry["path"]
    return file if file.is_file() else None


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)
