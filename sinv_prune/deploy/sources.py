"""Where an export finds what the model directory alone does not hold: the run's tokenizer and source GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from sinv_prune.surgery.keep_tokenizer import has_tokenizer


def run_gguf_source(run_dir: Path | None) -> Path | None:
    """The GGUF file a run's recipe loaded its model from (``model.gguf_file``), if it is still there."""
    recipe = run_dir / "recipe.yaml" if run_dir else None
    if recipe is None or not recipe.is_file():
        return None
    try:
        model = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("model") or {}
    except yaml.YAMLError:
        return None
    if not model.get("gguf_file") or not model.get("path"):
        return None
    path = str(model["path"])
    if path.startswith("pkg://"):
        spec = importlib.util.find_spec(path[len("pkg://") :])
        if spec is None or not spec.submodule_search_locations:
            return None
        path = list(spec.submodule_search_locations)[0]
    for base in (Path(path), run_dir / path, run_dir.parent / path):
        if (base / model["gguf_file"]).is_file():
            return (base / model["gguf_file"]).resolve()
    return None


def tokenizer_dir(model_dir: Path, run_dir: Path | None) -> Path | None:
    """The directory holding the tokenizer for ``model_dir``: itself, else the run's ``tokenizer/``."""
    for d in (model_dir, run_dir / "tokenizer" if run_dir else None):
        if d is not None and d.is_dir() and has_tokenizer(d):
            return d
    return None
