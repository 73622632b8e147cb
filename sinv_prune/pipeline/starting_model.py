"""The starting model: its config and class read without weights, its adapter on the meta device, and
the model itself (built from scratch or loaded).

Its own module because the preflight checks and the ``--dry-run`` estimate both ask these facts of
the recipe's model; neither owns them.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import torch
import transformers
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import HeadAdapter
from sinv_prune.pipeline.recipe import MOE_ARCHITECTURES, SCRATCH_ARCHITECTURES, Recipe, RecipeError, first_line


def is_masked_lm(model: nn.Module) -> bool:
    return type(model).__name__.removeprefix("SinvPruned").endswith("ForMaskedLM")


def scratch_config(recipe: Recipe, vocab_size: int | None = None, tokenizer=None):
    """The config of a model trained from scratch, sized by the recipe and the tokenizer."""
    config_name, _ = SCRATCH_ARCHITECTURES[recipe.model.architecture]
    extra = {}
    if tokenizer is not None:
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                extra[key] = value
    if vocab_size is not None:
        extra["vocab_size"] = vocab_size
    defaults = {}
    if recipe.model.architecture in MOE_ARCHITECTURES:
        # Trained from scratch, routers need the load-balancing loss (config.router_aux_loss_coef x the
        # Switch-style aux loss, added to the LM loss the Trainer minimises) or a few experts take every token.
        defaults["output_router_logits"] = True
    try:
        return getattr(transformers, config_name)(**{**defaults, **recipe.model.config, **extra})
    except (TypeError, ValueError) as err:
        raise RecipeError(f"model.config: {' '.join(str(err).split())}") from None


def build_model(recipe: Recipe, vocab_size: int | None = None, tokenizer=None) -> nn.Module:
    """The starting model: built from scratch (seeded) or loaded with ``sinv_prune.from_pretrained``."""
    from sinv_prune.pipeline.model_settings import load_kwargs, torch_dtype
    from sinv_prune.surgery.checkpoint import from_pretrained

    spec = recipe.model
    if spec.scratch:
        torch.manual_seed(recipe.seed)
        model_cls = getattr(transformers, SCRATCH_ARCHITECTURES[spec.architecture][1])
        config = scratch_config(recipe, vocab_size, tokenizer)
        if spec.attn_implementation is None:
            model = model_cls(config)
        else:
            model = model_cls._from_config(config, attn_implementation=spec.attn_implementation)
        dtype = torch_dtype(recipe)
        return model if dtype is None else model.to(dtype)  # initialised in float32 whatever the dtype
    kwargs = {k: v for k, v in (("gguf_file", spec.gguf_file), ("revision", spec.revision)) if v}
    return from_pretrained(recipe.resolve(spec.path), **kwargs, **load_kwargs(recipe))


def meta_adapter(recipe: Recipe) -> HeadAdapter:
    """The adapter of the starting model, built from its config alone (weights on the meta device)."""
    config, cls = starting_config(recipe)
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    try:
        return get_adapter(model)
    except ValueError as err:
        raise RecipeError(f"model: {err}") from None


def starting_config(recipe: Recipe) -> tuple[transformers.PretrainedConfig, type]:
    """The starting model's config and class, read without loading any weights."""
    from sinv_prune.surgery.checkpoint import model_class, pruned_class
    from sinv_prune.surgery.record import get_record

    spec = recipe.model
    if spec.scratch:
        config = scratch_config(recipe)  # the config's own vocabulary: only head sizes matter here
        cls = getattr(transformers, SCRATCH_ARCHITECTURES[spec.architecture][1])
    else:
        path = recipe.resolve(spec.path)
        _check_local_path(recipe)
        if spec.gguf_file and not (Path(path) / spec.gguf_file).is_file() and Path(path).is_dir():
            raise RecipeError(f"model.gguf_file: {Path(path) / spec.gguf_file} does not exist")
        kwargs = {k: v for k, v in (("gguf_file", spec.gguf_file), ("revision", spec.revision)) if v}
        try:
            config = copy.deepcopy(_read_config(path, tuple(sorted(kwargs.items())), _stamp(path, spec.gguf_file)))
        except (OSError, ValueError) as err:
            raise RecipeError(f"model.path: cannot load a config from {path!r} ({first_line(err)})") from None
        record = get_record(config)
        cls = model_class(config, record, gguf=bool(spec.gguf_file))
        if record is not None and not record.stock_layout:
            cls = pruned_class(cls)
    return config, cls


@functools.lru_cache(maxsize=8)
def _read_config(path: str, kwargs: tuple, stamp: int | None) -> transformers.PretrainedConfig:
    # Cached: reading a GGUF file's config takes seconds, and a dry run reads it twice.
    return transformers.AutoConfig.from_pretrained(path, **dict(kwargs))


def _stamp(path: str, gguf_file: str | None) -> int | None:
    """When the config (or GGUF) file last changed, so that the cache never serves a stale config."""
    local = Path(path) / (gguf_file or "config.json")
    return local.stat().st_mtime_ns if local.is_file() else None


def looks_like_path(text: str, base_dir: Path | None = None) -> bool:
    """Whether a model source names a local directory rather than a Hub id (``name`` or ``org/name``).

    Paths: ``./x``, ``../x``, ``/x``, ``~/x``, anything with more than one slash (or a backslash
    on Windows), and ``dir/name`` where ``dir`` exists under ``base_dir``.
    """
    if text.startswith(("./", "../", "~")) or text in (".", "..") or os.path.isabs(text):
        return True
    if (os.sep != "/" and os.sep in text) or text.count("/") > 1:
        return True
    return "/" in text and base_dir is not None and (base_dir / text.split("/", 1)[0]).is_dir()


def _check_local_path(recipe: Recipe) -> None:
    """A missing local ``model.path`` says so, instead of failing as an unknown Hub repo id."""
    raw = recipe.model.path
    if raw.startswith("pkg://") or not looks_like_path(raw, recipe._base_dir):
        return
    local = Path(raw).expanduser()
    local = local if local.is_absolute() else recipe._base_dir / local
    if not local.exists():
        raise RecipeError(f"model.path: no such directory: {local}")
