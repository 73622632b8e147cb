"""Everything checked before a run creates its directory.

A recipe that cannot run fails here with a :class:`~sinv_prune.pipeline.recipe.RecipeError` naming
the key: missing files, unknown criteria, unsupported architectures, arms that may empty layers
(``min_heads_per_layer: 0``) without ``prune.allow_empty_layers: true``, and arm parts whose amount
the model's heads (GQA groups, the arm's layout), MLP channels or layers cannot meet, and what the
GGUF export at the end of the run would refuse (type, llama.cpp architecture, the tokenizer's vocabulary).
"""

from __future__ import annotations

from pathlib import Path

from sinv_prune.arch.base import HeadAdapter, HeadLayout
from sinv_prune.pipeline.recipe import Recipe, RecipeError, first_line
from sinv_prune.pipeline.starting_model import is_masked_lm, meta_adapter
from sinv_prune.scoring.amounts import check_met
from sinv_prune.units import get_unit


def check_compensation(recipe: Recipe, adapter: HeadAdapter) -> None:
    """Each arm's compensation and rounds, against the starting model (before any training)."""
    from sinv_prune.scoring.criteria import criterion_class
    from sinv_prune.surgery import compensation

    for i, arm in enumerate(recipe.prune.arms):
        traced = [p.criterion for p in arm.part_specs if criterion_class(p.criterion).needs_trace]
        if arm.rounds > 1 and traced:
            raise RecipeError(
                f"prune.arms[{i}].rounds: {traced[0]} scores from the training trace, which cannot re-score "
                "an already pruned model; use rounds: 1"
            )
        if arm.compensate is None:
            continue
        options = {"ridge": None, **arm.compensate.prune_options()}
        try:
            compensation.check_options(
                adapter.model, adapter, options["compensate"], [], options["ridge"], options["add_bias"],
                options.get("precision", "float32"), options.get("holdout", compensation.HOLDOUT),
                options.get("target", "output"),
            )  # fmt: skip
        except ValueError as err:
            raise RecipeError(f"prune.arms[{i}].compensate: {first_line(err)}") from None


def check_export(recipe: Recipe, adapter: HeadAdapter) -> None:
    """``export.gguf``: what the export would refuse at the end of the run (type, quantiser, llama.cpp
    architecture, vocabulary), asked of the starting model's shapes and the run's tokenizer before any stage,
    as ``sinv-prune shrink --gguf`` asks it before its search (:func:`sinv_prune.deploy.check_gguf_export`)."""
    spec = recipe.export.gguf if recipe.export else None
    if spec is None:
        return
    from sinv_prune.deploy import check_gguf_export

    if spec.vocab and recipe.data.tokenizer.kind != "model":
        raise RecipeError(
            f"export.gguf: a tokenizer trained by the run (data.tokenizer.kind: {recipe.data.tokenizer.kind}) is not "
            "one llama.cpp can reproduce; set export.gguf.vocab: false for token-id-only files"
        )
    tokenizer, source = _export_vocabulary(recipe) if spec.vocab else (None, None)
    try:
        check_gguf_export(adapter.model, tokenizer, type=spec.type, verify=spec.verify, tokenizer_gguf=source,
                          vocab=spec.vocab)  # fmt: skip
    except (ValueError, ImportError) as err:
        raise RecipeError(f"export.gguf: {first_line(err)}") from None


def _export_vocabulary(recipe: Recipe) -> tuple[object | None, Path | None]:
    """``(tokenizer, source GGUF)`` as the export stage passes them: the tokenizer keys are copied from
    ``model.gguf_file`` when the model comes from one, else built from the model's own tokenizer."""
    from sinv_prune.data import load_model_tokenizer

    spec = recipe.model
    path = recipe.resolve(spec.path)
    if spec.gguf_file:
        source = Path(path) / spec.gguf_file
        if not source.is_file():
            raise RecipeError(f"export.gguf: the tokenizer is copied from model.gguf_file, and {source} is not a "
                              "local file; set export.gguf.vocab: false for token-id-only files")  # fmt: skip
        return None, source
    try:
        return load_model_tokenizer(path), None
    except (OSError, ValueError) as err:
        raise RecipeError(f"export.gguf: cannot load the model's tokenizer from {path} ({first_line(err)})") from None


def check_symmetry_breaking(recipe: Recipe, adapter: HeadAdapter) -> None:
    """Symmetry breaking only where a checkpoint can carry E[b] (see :mod:`sinv_prune.symmetry.folding`)."""
    from sinv_prune.symmetry.folding import fold_plan

    for stage in ("train", "finetune"):
        spec = getattr(recipe, stage)
        setting = spec.symmetry_breaking if spec is not None else None
        if setting is None:
            continue
        kinds = tuple(k for k in ("q", "v") if getattr(setting, f"b_{k}") is not None)
        if not kinds:
            raise RecipeError(f"{stage}.symmetry_breaking: b_q and b_v are both null: nothing to add")
        try:
            for layer in range(adapter.num_layers):
                fold_plan(adapter.attention(layer), adapter.model.config, kinds)
        except ValueError as err:
            raise RecipeError(f"{stage}.symmetry_breaking: {first_line(err)}") from None


def check_finetune(recipe: Recipe, model) -> None:
    """``finetune.data``'s local files exist; a teacher cache only for a causal LM, ``k`` within a pretrained
    model's vocabulary (a model from scratch takes the tokenizer's size, known once it is trained)."""
    spec = recipe.finetune
    if spec is None:
        return
    files = spec.data.files if spec.data is not None else None
    for i, name in enumerate([files] if isinstance(files, str) else files or []):
        if not Path(recipe.resolve(name)).exists():
            where = "finetune.data.files" + ("" if isinstance(files, str) else f"[{i}]")
            raise RecipeError(f"{where}: {recipe.resolve(name)} does not exist")
    generate = spec.data.generate if spec.data is not None else None
    if generate is not None and is_masked_lm(model):
        raise RecipeError("finetune.data.generate: a masked LM writes no text; give files or hub")
    if generate is not None and generate.prompt_tokens >= recipe.data.seq_len:
        raise RecipeError(f"finetune.data.generate.prompt_tokens ({generate.prompt_tokens}) must be below "
                          f"data.seq_len ({recipe.data.seq_len}): the model writes the rest of each block")  # fmt: skip
    k = spec.distill.cache_top_k if spec.distill is not None else None
    if k and is_masked_lm(model):
        raise RecipeError(
            "finetune.distill.cache_top_k: a masked LM's teacher sees a new masking every step, "
            "so its logits cannot be cached; drop cache_top_k"
        )
    vocab = getattr(model.config, "vocab_size", None)
    if k and not recipe.model.scratch and vocab and k > vocab:
        raise RecipeError(f"finetune.distill.cache_top_k: {k} is more than the model's vocabulary ({vocab} tokens)")


#: The pruning record's fields that say what the model was before it was pruned.
ORIGIN_FIELDS = ("base_class", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "num_experts", "expert_width", "shared_expert_width")  # fmt: skip


def check_loaded_arms(recipe: Recipe, adapter) -> None:
    """Each ``pruned: DIR`` arm's checkpoint was pruned from this recipe's model: a sinv_prune pruning record
    whose original shapes, vocabulary and width are the starting model's (read from the config alone)."""
    import json

    from sinv_prune.surgery.record import RECORD_KEY, PruningRecord
    from sinv_prune.surgery.removal import fresh_record

    for i, arm in enumerate(recipe.prune.arms):
        if arm.pruned is None:
            continue
        where = f"prune.arms[{i}].pruned"
        if recipe.model.scratch:
            raise RecipeError(f"{where}: the recipe trains its model from scratch, so no checkpoint was pruned from it")
        path = Path(recipe.resolve(arm.pruned))
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            raise RecipeError(f"{where}: {path} holds no model (no readable config.json)") from None
        if not config.get(RECORD_KEY):
            raise RecipeError(f"{where}: {path} is not a pruned model (its config has no sinv_prune record)")
        try:
            record = PruningRecord.from_json(config[RECORD_KEY])
        except ValueError as err:
            raise RecipeError(f"{where}: {err}") from None
        base = fresh_record(adapter.model, adapter)
        differ = [f"{k} {getattr(record, k)} (the recipe's model: {getattr(base, k)})" for k in ORIGIN_FIELDS
                  if getattr(record, k) is not None and getattr(record, k) != getattr(base, k)]  # fmt: skip
        base_config = adapter.model.config
        for key in ("vocab_size", "hidden_size"):
            mine = getattr(base_config, key, None)
            if key in config and mine is not None and config[key] != mine:
                differ.append(f"{key} {config[key]} (the recipe's model: {mine})")
        if differ:
            raise RecipeError(f"{where}: {path} was not pruned from the recipe's model: {'; '.join(differ)}")


def arm_parts(recipe: Recipe):
    """``(key path, part)`` for every part of every arm: ``prune.arms[1]`` or ``prune.arms[1].parts[0]``."""
    for i, arm in enumerate(recipe.prune.arms):
        if arm.auto is not None:
            continue  # shrink searches its own cut: check_auto
        if arm.parts is None:
            yield from ((f"prune.arms[{i}]", part) for part in arm.part_specs)  # a control arm has none
        else:
            for j, part in enumerate(arm.parts):
                yield f"prune.arms[{i}].parts[{j}]", part


def preflight(recipe: Recipe) -> list[HeadLayout]:
    """Check what can be checked before any work; returns the starting model's head layouts."""
    from sinv_prune.pipeline.distill import check_teacher
    from sinv_prune.pipeline.model_settings import check_model_settings
    from sinv_prune.pipeline.tasks import check_recipe_tasks
    from sinv_prune.scoring.criteria import criterion_class

    files = recipe.data.files
    if files is not None:
        for split in ("train", "valid", "test"):
            value = getattr(files, split)
            if value is not None and not Path(recipe.resolve(value)).is_file():
                raise RecipeError(f"data.files.{split}: {recipe.resolve(value)} does not exist")
    for where, part in arm_parts(recipe):
        _check_criterion(criterion_class, part.criterion, f"{where}.criterion")
        units = getattr(criterion_class(part.criterion), "units", ("heads",))
        if part.unit not in units:
            raise RecipeError(f"{where}.unit: criterion {part.criterion!r} scores {', '.join(units)}, not {part.unit}")
        kind = get_unit(part.unit)
        floor = next((key for key, field in kind.recipe_keys.items() if field == "min_per_layer"), None)
        empties = kind.min_floor == 0 and floor is not None and getattr(part, floor) == 0
        if empties and not recipe.prune.allow_empty_layers:
            raise RecipeError(
                f"{where}.{floor}: 0 lets layers lose every {kind.noun}; "
                f"set prune.allow_empty_layers: true to allow that (or keep {floor} >= 1)"
            )
    for i, name in enumerate(recipe.score.criteria):
        _check_criterion(criterion_class, name, f"score.criteria[{i}]")
    check_teacher(recipe)
    adapter = meta_adapter(recipe)
    check_model_settings(recipe, adapter.model)
    check_symmetry_breaking(recipe, adapter)
    check_compensation(recipe, adapter)
    check_recipe_tasks(recipe, is_masked_lm(adapter.model))
    check_finetune(recipe, adapter.model)
    check_loaded_arms(recipe, adapter)
    check_export(recipe, adapter)
    check_auto(recipe, adapter)
    layouts = [adapter.layout(i) for i in range(adapter.num_layers)]
    for where, part in arm_parts(recipe):
        check_amount(part, adapter, f"{where}.amount")
    return layouts


def check_auto(recipe: Recipe, adapter: HeadAdapter) -> None:
    """``auto`` arms: units the model has (with the fill units of its layers) and a ``to`` size shrink can reach."""
    from sinv_prune.scoring.allocation import non_embedding_parameters
    from sinv_prune.shrink.search import FILL_UNITS, model_units

    for i, arm in enumerate(recipe.prune.arms):
        if arm.auto is None:
            continue
        has = model_units(adapter)
        given = arm.auto.units
        if given is not None and (set(given) - set(has) or not {u for u in has if u in FILL_UNITS} <= set(given)):
            fill = " and ".join(u for u in has if u in FILL_UNITS)
            raise RecipeError(f"prune.arms[{i}].auto.units: {given} for a model with {', '.join(has)}: they must be "
                              f"among those and include {fill} (the units that meet the target to a step)")  # fmt: skip
        if arm.auto.to is not None:
            total = sum(p.numel() for p in adapter.model.parameters())
            free = non_embedding_parameters(adapter.model)
            if not total - free < arm.auto.to < total:
                raise RecipeError(f"prune.arms[{i}].auto.to: {arm.auto.to:,} is not between the embeddings' "
                                  f"{total - free:,} and the model's {total:,} parameters")  # fmt: skip


def check_amount(part, adapter: HeadAdapter, where: str) -> None:
    """Whether the starting model has what ``part`` asks to remove (from its config: meta weights)."""
    try:
        check_met(adapter, part.unit, part.amount, mode=part.mode, allocation=part.allocation,
                  options=part.part_options())  # fmt: skip
    except ValueError as err:
        raise RecipeError(f"{where}: {first_line(err)}") from None


def _check_criterion(lookup, name: str, where: str) -> None:
    try:
        lookup(name)
    except (KeyError, ValueError) as err:
        raise RecipeError(f"{where}: {first_line(err)}") from None
