"""The stages of a recipe run: train -> score -> prune -> finetune -> evaluate -> report.

``run_recipe`` is what ``sinv-prune RECIPE`` calls, and what API users can call too.
Each stage writes its outputs atomically and is recorded in ``state.json`` when it
finishes, so ``resume=True`` picks up after the last finished stage (and from the last
Trainer checkpoint inside a training stage).

Under ``torchrun`` / ``accelerate launch`` (see :mod:`sinv_prune.pipeline.ranks`) the main process alone
prepares the data, scores, prunes, evaluates, reports and pushes; every process joins the train and
fine-tune stages through the Trainer, loading the model it trains from the run directory. Only the
main process writes to the run directory and logs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sinv_prune import data as data_mod
from sinv_prune.log_level import log_level
from sinv_prune.pipeline.device_choice import default_device
from sinv_prune.pipeline.evaluation import (
    compare_speed,
    fits_together,
    mlm_loss,
    parameter_breakdown,
    perplexity,
    speedup_fields,
)
from sinv_prune.pipeline.model_settings import (
    input_device,
    load_kwargs,
    merge_lora,
    to_device,
    unloadable_reason,
    wrap_lora,
)
from sinv_prune.pipeline.preflight import preflight
from sinv_prune.pipeline.ranks import Ranks
from sinv_prune.pipeline.recipe import DEFAULT_UNIT, ArmSpec, PartSpec, Recipe, recipe_to_yaml
from sinv_prune.pipeline.report import removed_text, write_report
from sinv_prune.pipeline.routing import routing_statistics
from sinv_prune.pipeline.starting_model import build_model, is_masked_lm
from sinv_prune.pipeline.tasks import model_tasks
from sinv_prune.pipeline.threads import parse_threads, recipe_threads
from sinv_prune.pipeline.training import remove_checkpoints, run_trainer
from sinv_prune.progress import bar
from sinv_prune.rundir import RunDir, write_dir, write_json, write_text
from sinv_prune.scoring.allocation import needs_data
from sinv_prune.scoring.criteria import Criterion, StoredScores, criterion_class, get_criterion
from sinv_prune.scoring.pruner import HeadPruner, Part, Pruner
from sinv_prune.strict_json import with_null_reasons
from sinv_prune.surgery.checkpoint import from_pretrained
from sinv_prune.surgery.removal import PruneSummary, count_parameters
from sinv_prune.units import get_unit
from sinv_prune.units import units as registered_units

logger = logging.getLogger("sinv_prune")
#: ``extra=`` of the log lines the console shows at default verbosity (one per finished stage or arm);
#: every other INFO line goes to ``run.log`` only (``sinv-prune -v`` shows them too).
CONSOLE = {"console": True}


@dataclass
class Run:
    """Everything a stage needs: the recipe, the run directory, data and the base model."""

    recipe: Recipe
    dir: RunDir
    device: str
    quiet: bool
    keep_checkpoints: bool = False
    tokenizer: Any = None
    ids: dict[str, torch.Tensor] = field(default_factory=dict)
    base: Any = None  # the starting model, on the main process only
    ranks: Ranks = field(default_factory=Ranks)

    @property
    def root(self) -> Path:
        return self.dir.root

    @property
    def mlm(self) -> bool:
        return is_masked_lm(self.base)


def run_recipe(
    recipe: Recipe,
    output: str | Path,
    *,
    overwrite: bool = False,
    resume: bool = False,
    device: str | None = None,
    quiet: bool = False,
    threads: int | str | None = "auto",
    keep_checkpoints: bool = False,
) -> dict:
    """Run every stage of ``recipe`` into the directory ``output``; returns ``results.json``'s content.

    ``threads``: torch CPU threads during the run, ``"auto"`` (see :func:`sinv_prune.pipeline.threads.choose_threads`),
    a number, or None to leave torch's setting alone. Trainer checkpoints (with optimizer state,
    several times the model's size) are deleted once their stage has saved its final model,
    unless ``keep_checkpoints``.
    """
    preflight(recipe)
    threads = parse_threads(threads)
    device = default_device(device, recipe.device, input_device(recipe))
    ranks = Ranks(device)
    run_dir = ranks.on_main(lambda: RunDir.open(Path(output), overwrite=overwrite, resume=resume))
    run = Run(recipe, run_dir, device, quiet or not ranks.is_main, keep_checkpoints=keep_checkpoints, ranks=ranks)
    stack = contextlib.ExitStack()
    stack.enter_context(_main_logs_only(run))
    try:
        stack.enter_context(recipe_threads(recipe, threads))
        _on_main(run, lambda: write_text(run.root / "recipe.yaml", recipe_to_yaml(recipe)))
        logger.info("run %s in %s on %s (resume=%s, processes=%d)", recipe.name, run.root, device, resume,
                    ranks.world_size, extra=CONSOLE)  # fmt: skip
        prepare_data(run)
        stage_train(run)
        _on_main(run, lambda: stage_score(run))
        _on_main(run, lambda: stage_prune(run))
        stage_finetune(run)
        results = _on_main(run, lambda: stage_evaluate(run))
        results = _on_main(run, lambda: stage_export(run, results))
        _on_main(run, lambda: stage_report(run, results))
        _on_main(run, lambda: stage_push(run, results))
        return results
    finally:
        stack.close()


def _on_main(run: Run, fn):
    """``fn()`` on the main process; the others wait, then take its result and the run's state."""
    value, state = run.ranks.on_main(lambda: (fn(), run.dir.state))
    run.dir.state = state
    return value


@contextlib.contextmanager
def _main_logs_only(run: Run):
    """The run log (``run.log``) on the main process; the other processes log warnings only."""
    if not run.ranks.is_main:
        with log_level("sinv_prune", logging.WARNING):
            yield
        return
    handler = _log_to_file(run.root / "run.log")
    try:
        yield
    finally:
        logging.getLogger("sinv_prune").removeHandler(handler)
        logging.getLogger("transformers").removeHandler(handler)
        handler.close()


# -- data and the starting model --------------------------------------------------------------


def prepare_data(run: Run) -> None:
    """Load the corpus and the tokenizer (trained on the train split when asked); token streams per split.

    Under a launcher the main process does it and writes the token streams to ``tokens/ids.pt``;
    the others wait, then read the tokenizer and the streams from the run directory.
    """
    tokens = run.root / "tokens"

    def main() -> None:
        _prepare_data(run)
        if run.ranks.world_size > 1:
            write_dir(tokens, lambda d: torch.save(run.ids, d / "ids.pt"))

    _on_main(run, main)
    if not run.ranks.is_main:
        run.tokenizer = data_mod.load_model_tokenizer(str(run.root / "tokenizer"))
        run.ids = torch.load(tokens / "ids.pt")


def _prepare_data(run: Run) -> None:
    spec = run.recipe.data
    corpus = load_corpus(run.recipe)
    tok_dir = run.root / "tokenizer"
    if tok_dir.exists():
        run.tokenizer = data_mod.load_model_tokenizer(str(tok_dir))
    elif spec.tokenizer.kind == "model":
        model_spec = run.recipe.model
        run.tokenizer = data_mod.load_model_tokenizer(
            run.recipe.resolve(model_spec.path), gguf_file=model_spec.gguf_file
        )
        write_dir(tok_dir, run.tokenizer.save_pretrained)
    else:
        run.tokenizer = data_mod.train_tokenizer(
            corpus["train"],
            kind=spec.tokenizer.kind,
            vocab_size=spec.tokenizer.vocab_size,
            mlm=run.recipe.model.architecture in ("bert", "roberta"),
        )
        write_dir(tok_dir, run.tokenizer.save_pretrained)
    for split in corpus:
        run.ids[split] = data_mod.token_ids(corpus[split], run.tokenizer)
    logger.info("data: %s tokens", {k: int(v.numel()) for k, v in run.ids.items()}, extra=CONSOLE)


def load_corpus(recipe: Recipe):
    """The recipe's text splits as a ``datasets.DatasetDict`` (train / valid / test where given)."""
    spec = recipe.data
    if spec.synthetic is not None:
        s = spec.synthetic
        return data_mod.synthetic_corpus(num_train=s.num_train, num_valid=s.num_valid, num_test=s.num_test, seed=s.seed)
    if spec.files is not None:
        files = {k: recipe.resolve(v) for k, v in spec.files.model_dump().items() if v is not None}
        return data_mod.load_text_splits(files)
    return data_mod.load_text_splits(spec.hub.path, spec.hub.name, text_column=spec.hub.text_column)


def _eval_split(run: Run) -> str:
    return "test" if "test" in run.ids else "valid"


def _score_split(run: Run) -> str:
    return "valid" if "valid" in run.ids else ("train" if "train" in run.ids else "test")


def stage_train(run: Run) -> None:
    """Build or load the starting model; train it if the recipe says so; save it as ``base/``.

    Every process trains (the Trainer shards the data); the main process saves and keeps the model.
    """
    base_dir = run.root / "base"
    if run.dir.done("train"):
        if run.ranks.is_main:
            _drop_checkpoints(run, run.root / "checkpoints" / "train")  # in case a run stopped right after the stage
            run.base = to_device(load_saved(run, base_dir), run.device)
        return
    if run.recipe.train is None and not run.ranks.is_main:
        _on_main(run, lambda: None)  # the main process builds and saves the base model
        return
    model = build_model(run.recipe, vocab_size=len(run.tokenizer), tokenizer=run.tokenizer)
    if run.recipe.model.device_map is not None and (reason := unloadable_reason(model)):
        raise RunStageError(reason)
    spec = run.recipe.train
    if spec is not None:
        from sinv_prune.pipeline.tracking import ConvergenceCallback

        if "train" not in run.ids:
            raise ValueError("the train stage needs a train split (data.files.train or a synthetic/hub corpus)")
        callbacks = []
        if spec.tracking is not None:
            t = spec.tracking
            callbacks.append(
                ConvergenceCallback(
                    run.root / "trace.jsonl",
                    every_n_steps=t.every_n_steps,
                    threshold=t.threshold,
                    stop=t.stop,
                    freeze_converged=t.freeze_converged,
                )
            )
        seq = run.recipe.data.seq_len
        eval_blocks = data_mod.lm_blocks(run.ids["valid"], seq) if "valid" in run.ids else None
        out = run_trainer(
            model,
            run.tokenizer,
            data_mod.lm_blocks(run.ids["train"], seq),
            eval_blocks,
            spec,
            run.root / "checkpoints" / "train",
            mlm=is_masked_lm(model),
            seed=run.recipe.seed,
            device=run.device,
            quiet=run.quiet,
            callbacks=callbacks,
            resume=True,
        )
        run.dir.state["train"] = {"steps": out.global_step, "train_loss": out.training_loss}
        logger.info("trained the base model: %d steps, train loss %.4f, %.0f s", out.global_step, out.training_loss,
                    out.metrics.get("train_runtime", 0.0), extra=CONSOLE)  # fmt: skip

    def save() -> None:
        _save_model(model, run.tokenizer, base_dir)
        run.base = to_device(model, run.device).eval()
        run.dir.finish("train")
        _drop_checkpoints(run, run.root / "checkpoints" / "train")

    _on_main(run, save)


def _drop_checkpoints(run: Run, trainer_dir: Path) -> None:
    """A finished stage's Trainer checkpoints, unless the run keeps them (``run/checkpoints/`` too once empty)."""
    if run.keep_checkpoints:
        return
    remove_checkpoints(trainer_dir)
    if trainer_dir.parent.name == "checkpoints" and trainer_dir.parent.is_dir():
        remove_checkpoints(trainer_dir.parent)


def load_saved(run: Run, path: Path):
    """A checkpoint this run saved (or a teacher), loaded with the recipe's dtype, device_map and attention."""
    return from_pretrained(path, **load_kwargs(run.recipe))


def _save_model(model, tokenizer, path: Path) -> None:
    def write(d: Path) -> None:
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)

    write_dir(path, write)


# -- scoring and pruning ------------------------------------------------------------------------


def criterion_key(arm: ArmSpec | PartSpec | str) -> str:
    """One scoring per distinct criterion + unit + options (random keeps its seed in the arm)."""
    if isinstance(arm, str):
        return arm
    part = arm.part_specs[0] if isinstance(arm, ArmSpec) else arm
    unit = "" if part.unit == DEFAULT_UNIT else f"@{part.unit}"
    opts = ",".join(f"{k}={v}" for k, v in sorted(part.options.items()))
    return f"{part.criterion}{unit}({opts})" if opts else f"{part.criterion}{unit}"


def part_criterion(part: PartSpec) -> Criterion:
    """The criterion of one arm part, built by name (a ``seed`` it takes defaults to the part's seed)."""
    cls = criterion_class(part.criterion)
    options = dict(part.options)
    if "seed" in inspect.signature(cls).parameters:
        options.setdefault("seed", part.seed)
    if part.unit != DEFAULT_UNIT:
        options["unit"] = part.unit
    return get_criterion(part.criterion, **options)


def arm_pruner(run: Run, arm: ArmSpec, criteria: list[Criterion | None] | None = None):
    """The pruner that scores, selects and removes what ``arm`` says; the one place arms become pruners.

    ``criteria`` (one per part; None: :func:`part_criterion`) replaces a part's criterion, e.g.
    with the :class:`StoredScores` of stage ``score``. A single-part heads arm gets a
    :class:`HeadPruner`; MLP channels, layers and mixed cuts a :class:`Pruner` of :class:`Part` s.
    """
    parts = arm.part_specs
    given = criteria or [None] * len(parts)
    criteria = [c if c is not None else part_criterion(p) for p, c in zip(parts, given, strict=True)]
    options = arm.compensate.prune_options() if arm.compensate else {}
    compensate = options.pop("compensate", None)
    if compensate is not None:  # the block-by-block refit: notes with an ETA in the run's log
        options["progress"] = not (run is not None and run.quiet)
    if arm.heads_only and parts[0].allocation == "uniform" and not isinstance(parts[0].amount, dict):
        part = parts[0]
        return HeadPruner(
            criteria[0],
            part.amount,
            mode=part.mode,
            layout=part.layout,
            min_heads_per_layer=part.min_heads_per_layer,
            seed=part.seed,
            rounds=arm.rounds,
            compensate=compensate,
            compensation_options=options,
        )
    built = []
    for part, criterion in zip(parts, criteria, strict=True):
        extra: dict[str, Any] = part.part_options()
        if part.allocation != "uniform":
            extra.update(allocation=part.allocation, allocation_options=part.allocation_options or None)
        built.append(Part(part.unit, criterion, part.amount, mode=part.mode, seed=part.seed, **extra))
    quiet = run is not None and run.quiet
    return Pruner(built, rounds=arm.rounds, compensate=compensate, compensation_options=options, quiet=quiet)


def stage_score(run: Run) -> None:
    """Score the base model with every criterion the arms' parts (and ``score.criteria``) use.

    The criteria are the ones :func:`arm_pruner` gives the pruners (:func:`part_criterion`); the
    scores go to ``scores.json``, from which stage ``prune`` selects (so ``resume`` does not re-score).
    """
    path = run.root / "scores.json"
    if run.dir.done("score"):
        return
    spec = run.recipe.score
    wanted: dict[str, PartSpec] = {name: PartSpec(criterion=name, amount=1) for name in spec.criteria}
    for arm in run.recipe.prune.arms:
        for part in arm.part_specs:
            wanted.setdefault(criterion_key(part), part)
    results = {}
    for key, part in wanted.items():
        if part.criterion == "random":
            continue  # drawn per arm from the arm's seed
        crit = part_criterion(part)
        start = time.perf_counter()
        batches = _score_batches(run) if crit.needs_data else None
        trace = run.root / "trace.jsonl" if crit.needs_trace else None
        scores = crit.compute(run.base, batches=batches, trace=trace)
        results[key] = {"scores": scores, "report": crit.report(), "seconds": time.perf_counter() - start}
        logger.info("scored %s in %.1fs", key, results[key]["seconds"], extra=CONSOLE)
        if crit.report():
            logger.info("score report %s: %s", key, crit.report())
    write_json(path, with_null_reasons(results))
    run.dir.finish("score")


def _score_batches(run: Run):
    spec = run.recipe.score
    blocks = data_mod.lm_blocks(run.ids[_score_split(run)], run.recipe.data.seq_len)
    n = min(spec.batches * spec.batch_size, len(blocks))
    ids = torch.tensor(blocks[:n]["input_ids"])
    chunks = list(torch.split(ids, spec.batch_size))
    for chunk in bar(chunks, desc="scoring", unit="batch", disable=run.quiet):
        batch = {"input_ids": chunk.to(run.device)}
        if is_masked_lm(run.base):
            batch = _mask_batch(run, batch["input_ids"])
        yield batch


def _mask_batch(run: Run, ids: torch.Tensor) -> dict:
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(run.tokenizer, mlm=True, seed=run.recipe.seed)
    batch = collator([{"input_ids": row} for row in ids.cpu()])
    return {k: v.to(run.device) for k, v in batch.items()}


def stored_criteria(arm: ArmSpec, scores: dict) -> list[Criterion | None]:
    """Per part of ``arm``, its stage-``score`` scores as a criterion (None for random: drawn from the arm's seed)."""
    out: list[Criterion | None] = []
    for part in arm.part_specs:
        if part.criterion == "random":
            out.append(None)
            continue
        entry = scores[criterion_key(part)]
        out.append(StoredScores(part.criterion, part.unit, entry["scores"], entry.get("report")))
    return out


def arm_heads(run: Run, arm: ArmSpec, scores: dict) -> dict[int, list[int]]:
    """The heads a single-part heads arm removes from the base model, given stage ``score``'s scores."""
    return arm_pruner(run, arm, stored_criteria(arm, scores)).select(run.base)[arm.part_specs[0].unit]


def fresh_base(run: Run):
    """A new copy of the starting model, read from ``base/`` on disk, on the run's device, in eval mode.

    Arms prune such copies (one at a time, released after saving), so a run holds at most the
    base model and one arm's model, however many arms it has.
    """
    return to_device(load_saved(run, run.root / "base"), run.device).eval()


def release() -> None:
    """Free models the caller has dropped: collect reference cycles now, and the device's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_prune(run: Run) -> None:
    """Every arm starts from the same base model, so criteria compare on equal terms.

    One round: the arm's pruner selects from stage ``score``'s scores. Several rounds re-score
    the pruned model each round, so that pruner scores itself (on the scoring batches).
    """
    import json

    scores = json.loads((run.root / "scores.json").read_text())
    for arm in run.recipe.prune.arms:
        state = run.dir.arm(arm.label)
        if state.get("pruned"):
            continue
        if arm.pruned is not None:
            _loaded_arm(run, arm, state)
            continue
        model = fresh_base(run)
        calibration = _calibration_batches(run, arm.compensate) if arm.compensate else None
        if arm.control:
            n = count_parameters(model)
            summary = PruneSummary(layers=[], params_before=n, params_after=n)
        elif arm.auto is not None:
            summary = _shrink_arm(run, arm, model, state)
        elif arm.rounds > 1:
            criteria = [part_criterion(p) for p in arm.part_specs]
            pruner = arm_pruner(run, arm, criteria)
            batches = list(_score_batches(run)) if any(c.needs_data for c in criteria) else None
            trace = run.root / "trace.jsonl" if any(c.needs_trace for c in criteria) else None
            summary = pruner.prune(model, batches=batches, trace=trace, calibration=calibration)
            state["rounds"] = pruner.last_rounds
        else:
            pruner = arm_pruner(run, arm, stored_criteria(arm, scores))
            # allocations that measure the model (sensitivity, search): calibration batches, else scoring ones
            measured = any(needs_data(p.allocation) for p in arm.part_specs)
            batches = list(_score_batches(run)) if measured and calibration is None else None
            summary = pruner.prune(model, batches=batches, calibration=calibration)
            if getattr(pruner, "last_allocation", None):
                state["allocation"] = pruner.last_allocation
        path = run.root / "arms" / _safe(arm.label) / "pruned"
        _save_model(model, run.tokenizer, path)
        state.update(
            pruned=True,
            criterion=arm.criterion_names,
            **{f"{u.plural}_removed": u.count(summary.removed(u.name)) for u in registered_units()},
            **_removed_fields(model),
            pruned_dir=str(path.relative_to(run.root)),
        )
        if summary.compensation is not None:
            state["compensation"] = summary.compensation.to_dict()
        run.dir.save()
        logger.info("arm %s: removed %s -> %s", arm.label, removed_text(state), path, extra=CONSOLE)
        if summary.compensation is not None:
            logger.info("arm %s: %s", arm.label, str(summary.compensation).splitlines()[0])
        del model, summary, calibration
        release()
    run.dir.finish("prune")


def _removed_fields(model) -> dict[str, Any]:
    """What the model's pruning record says it lost (original numbering, JSON keys), for the arm's state."""
    record = getattr(model.config, "sinv_prune", None) or {}  # a control arm's model has no record
    channels = {**record.get("pruned_mlp", {}), **record.get("pruned_expert_channels", {})}
    return {
        "removed": record.get("pruned_heads", {}),
        "removed_channels": {layer: len(c) for layer, c in channels.items()},  # dense, or inside the experts
        "removed_experts": record.get("pruned_experts", {}),
        "removed_layers": record.get("removed_layers", []),
    }


def _loaded_arm(run: Run, arm: ArmSpec, state: dict) -> None:
    """A ``pruned: DIR`` arm: the checkpoint (checked against the base in preflight) copied into the run as
    the arm's pruned model, what it removed read from its pruning record."""
    from sinv_prune.surgery.record import get_record

    source = Path(run.recipe.resolve(arm.pruned))
    model = load_saved(run, source)
    record = get_record(model.config)
    path = run.root / "arms" / _safe(arm.label) / "pruned"
    _save_model(model, run.tokenizer, path)
    state.update(
        pruned=True,
        criterion=arm.criterion_names,
        loaded_from=str(source.resolve()),
        **{f"{u.plural}_removed": u.count(u.recorded(record)) for u in registered_units()},
        **_removed_fields(model),
        pruned_dir=str(path.relative_to(run.root)),
    )
    run.dir.save()
    logger.info("arm %s: loaded %s (removed %s) -> %s", arm.label, arm.pruned, removed_text(state), path,
                extra=CONSOLE)  # fmt: skip
    del model
    release()


def _shrink_arm(run: Run, arm: ArmSpec, model, state: dict):
    """Prune ``model`` by :func:`sinv_prune.shrink` on the scoring split's first ``auto.batches`` blocks."""
    from sinv_prune.shrink import shrink

    blocks = data_mod.lm_blocks(run.ids[_score_split(run)], run.recipe.data.seq_len)
    ids = torch.tensor(blocks[: arm.auto.batches]["input_ids"])
    result = shrink(model, calibration=list(ids), length=ids.shape[1], quiet=run.quiet, **arm.auto.shrink_options())
    state["shrink"] = {k: v for k, v in result.to_dict().items() if k != "plan"}
    logger.info("arm %s: %s", arm.label, str(result).splitlines()[0], extra=CONSOLE)
    return result.summary


def _calibration_batches(run: Run, spec) -> list[dict]:
    """``spec.batches`` batches of ``spec.batch_size`` sequences from the scoring split, on the run's device."""
    blocks = data_mod.lm_blocks(run.ids[_score_split(run)], run.recipe.data.seq_len)
    n = min(spec.batches * spec.batch_size, len(blocks))
    ids = torch.tensor(blocks[:n]["input_ids"])
    return [{"input_ids": chunk.to(run.device)} for chunk in torch.split(ids, spec.batch_size)]


def stage_finetune(run: Run) -> None:
    """Fine-tune every arm (LM loss, or distillation from one teacher loaded once for all arms, or from its
    top-k logits cached once for all arms: ``distill.cache_top_k``), on the same blocks.

    Every process loads the pruned arm from disk and trains it; the main process saves it.
    """
    from sinv_prune.pipeline.data_stream import finetune_blocks

    spec = run.recipe.finetune
    if spec is None or run.dir.done("finetune"):
        return
    main = run.ranks.is_main
    blocks = finetune_blocks(run)
    teacher, cache = None, None
    for arm in run.recipe.prune.arms:
        state = run.dir.arm(arm.label)
        arm_dir = run.root / "arms" / _safe(arm.label)
        if state.get("finetuned"):
            if main:
                _drop_checkpoints(run, arm_dir / "checkpoints")
            continue
        model = load_saved(run, run.root / state["pruned_dir"])
        if spec.distill is not None and spec.distill.cache_top_k and cache is None:
            from sinv_prune.pipeline.distill_cache import run_cache

            cache = run_cache(run, blocks, lambda m=model: to_device(load_teacher(run, m), run.device))
            release()
        elif spec.distill is not None and not spec.distill.cache_top_k and teacher is None:
            teacher = load_teacher(run, model)
        if spec.lora is not None:
            model = wrap_lora(model, spec.lora)
        callbacks = _recovery_callbacks(run, model, arm_dir)
        out = run_trainer(
            model,
            run.tokenizer,
            blocks,
            None,
            spec,
            arm_dir / "checkpoints",
            mlm=is_masked_lm(model),
            seed=run.recipe.seed,
            device=run.device,
            quiet=run.quiet,
            callbacks=callbacks,
            resume=True,
            teacher=teacher,
            teacher_cache=cache,
            desc=f"fine-tuning {arm.label}",
        )
        if spec.lora is not None:
            model = merge_lora(model)
        curve = callbacks[0].points if callbacks else None
        _on_main(run, functools.partial(_save_finetuned, run, model, arm_dir, state, out, curve, blocks.seq_len))
        del model, out
        release()
    del teacher, cache
    release()
    _on_main(run, lambda: run.dir.finish("finetune"))


def _recovery_callbacks(run: Run, model, arm_dir: Path) -> list:
    """``[RecoveryCurve]`` when the recipe asks for a recovery curve (``finetune.eval_every_tokens``), else ``[]``."""
    spec = run.recipe.finetune
    if spec.eval_every_tokens is None:
        return []
    from sinv_prune.pipeline.recovery import RecoveryCurve, curve_evaluator

    evaluate = curve_evaluator(run, is_masked_lm(model))
    return [RecoveryCurve(evaluate, spec.eval_every_tokens, run.recipe.data.seq_len, arm_dir / "recovery.json")]


def _save_finetuned(run: Run, model, arm_dir: Path, state: dict, out, curve, seq_len: int) -> None:
    from sinv_prune.pipeline.training import tokens_per_step

    spec = run.recipe.finetune
    _save_model(model, run.tokenizer, arm_dir / "finetuned")
    state.update(finetuned=True, finetuned_dir=str((arm_dir / "finetuned").relative_to(run.root)))
    seen = out.global_step * tokens_per_step(spec, seq_len, run.ranks.world_size)
    state["finetune"] = {"steps": out.global_step, "tokens": seen, "train_loss": out.training_loss}
    logger.info("arm %s: fine-tuned %d steps (%d tokens), train loss %.4f, %.0f s", arm_dir.name, out.global_step,
                seen, out.training_loss, out.metrics.get("train_runtime", 0.0), extra=CONSOLE)  # fmt: skip
    if spec.distill is not None:
        distill = spec.distill.model_dump()
        if distill["cache_top_k"] is None:
            del distill["cache_top_k"], distill["cache_dtype"]
        if not distill["hidden_weight"]:
            del distill["hidden_weight"], distill["hidden_layers"], distill["hidden_inputs"]
        state["finetune"]["distill"] = distill
    if spec.lora is not None:
        state["finetune"]["lora"] = spec.lora.model_dump()
    if curve is not None:
        from sinv_prune.strict_json import null_non_finite

        state["finetune"]["recovery_curve"] = null_non_finite(curve)[0]
    run.dir.save()
    _drop_checkpoints(run, arm_dir / "checkpoints")


def load_teacher(run: Run, student):
    """The distillation teacher, from disk (``base`` is the run's saved starting model); checked against ``student``."""
    name = run.recipe.finetune.distill.teacher
    path = run.root / "base" if name == "base" else Path(run.recipe.resolve(name))
    teacher = load_saved(run, path)
    where = f"finetune.distill.teacher ({name})"
    if is_masked_lm(teacher) != is_masked_lm(student):
        raise RunStageError(f"{where}: a {_task(teacher)} cannot teach a {_task(student)}")
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (teacher, student)]
    if sizes[0] != sizes[1]:
        raise RunStageError(f"{where}: its vocabulary has {sizes[0]} tokens, the student's {sizes[1]}")
    logger.info("distillation teacher: %s (%s)", name, path)
    return teacher.eval().requires_grad_(False)


def _task(model) -> str:
    return "masked LM" if is_masked_lm(model) else "causal LM"


# -- evaluation and report ----------------------------------------------------------------------


def evaluate_model(run: Run, model, label: str, *, kind: str = "baseline", offload: bool = False) -> dict:
    """Perplexity (or MLM loss), parameter counts and speed of one model; for a mixture-of-experts
    causal LM also ``routing``, each expert's share of the router's choices on the evaluation text
    (:mod:`sinv_prune.pipeline.routing`). ``kind`` (``baseline``, ``pruned``, ``finetuned``): the
    recipe's tasks run when ``evaluate.tasks_on`` names it.

    ``offload``: the base model waits on the CPU, and the speed comparison moves the two models
    to the device in turn (they do not fit there together).
    """
    spec, data = run.recipe.evaluate, run.recipe.data
    model = to_device(model, run.device).eval()
    ids = run.ids[_eval_split(run)]
    out: dict[str, Any] = {"params": count_parameters(model), "params_breakdown": parameter_breakdown(model)}
    stride = data.eval_stride or data.seq_len
    if is_masked_lm(model):
        res = mlm_loss(
            model,
            ids,
            seq_len=data.seq_len,
            seed=run.recipe.seed,
            batch_size=spec.window_batch_size,
            mask_token_id=run.tokenizer.mask_token_id,
            special_ids=tuple(run.tokenizer.all_special_ids),
            max_tokens=data.max_eval_tokens,
        )
        out.update(perplexity=res["mlm_perplexity"], nll=res["mlm_loss"], eval=res)
    else:
        res = perplexity(
            model,
            ids,
            seq_len=data.seq_len,
            stride=stride,
            batch_size=spec.window_batch_size,
            max_tokens=data.max_eval_tokens,
            progress=not run.quiet,
        )
        out.update(perplexity=res["perplexity"], nll=res["nll"], eval=res)
        routing = routing_statistics(
            model, ids, seq_len=data.seq_len, batch_size=spec.window_batch_size, max_tokens=data.max_eval_tokens
        )
        if routing is not None:  # a mixture-of-experts model: how often each expert is chosen (original numbering)
            out["routing"] = routing
    tasks = kind in spec.tasks_on
    out.update(model_tasks(run.recipe, run.root, run.tokenizer, model, masked_lm=is_masked_lm(model), label=label,
                           tasks=tasks))  # fmt: skip
    if spec.speed:
        # Interleaved with the baseline in one process, so machine load hits both alike.
        speed = compare_speed(
            run.base,
            model,
            batch_size=spec.speed_batch_size,
            seq_len=spec.speed_seq_len or data.seq_len,
            repeats=spec.speed_repeats,
            device=run.device,
            control=True,
            offload=offload,
        )
        out["speed"] = {**speed["b"], **speedup_fields(speed), **({"offload": True} if offload else {})}
    logger.info("evaluated %s: ppl %.3f, %d params", label, out["perplexity"], out["params"], extra=CONSOLE)
    return out


def stage_evaluate(run: Run) -> dict:
    """Baseline and every arm, after pruning and (if fine-tuned) after fine-tuning."""
    import json

    path = run.root / "evaluation.json"
    if run.dir.done("evaluate"):
        return json.loads(path.read_text())
    results: dict[str, Any] = {"baseline": evaluate_model(run, run.base, "baseline"), "arms": []}
    scores = json.loads((run.root / "scores.json").read_text())
    # An arm is never larger than the base: two copies of the base bound what the device must hold.
    offload = run.recipe.evaluate.speed and not fits_together([run.base, run.base], run.device)
    if offload:
        logger.info("base and arm do not fit on %s together: the base waits on the CPU", run.device)
        run.base.to("cpu")
    for arm in run.recipe.prune.arms:
        state = run.dir.arm(arm.label)
        pruned = load_saved(run, run.root / state["pruned_dir"])
        row: dict[str, Any] = {
            "name": arm.label,
            "criterion": arm.criterion_names,
            **_arm_fields(arm),
            "compensate": arm.compensate.model_dump() if arm.compensate else None,
            "compensation": state.get("compensation"),
            "allocation": [_allocation_row(a) for a in state.get("allocation", [])] or None,
            "rounds": arm.rounds,
            "per_round": state.get("rounds"),
            "heads_removed": state["heads_removed"],
            **{f"{u.plural}_removed": state.get(f"{u.plural}_removed", 0) for u in registered_units()},
            **{k: state.get(k) for k in ("removed", "removed_channels", "removed_experts", "removed_layers")},
            # a control arm's model is the base: its evaluation is the baseline's
            "pruned": dict(results["baseline"])
            if arm.control
            else evaluate_model(run, pruned, f"{arm.label} (pruned)", kind="pruned", offload=offload),
            "model_dir": state["pruned_dir"],
            "score_report": scores.get(criterion_key(arm), {}).get("report", {}) if arm.part_specs else {},
            "shrink": state.get("shrink"),
            "loaded_from": state.get("loaded_from"),  # a ``pruned: DIR`` arm's checkpoint
        }
        del pruned
        if state.get("finetuned"):
            tuned = load_saved(run, run.root / state["finetuned_dir"])
            row["finetuned"] = evaluate_model(run, tuned, f"{arm.label} (fine-tuned)", kind="finetuned",
                                              offload=offload)  # fmt: skip
            row["model_dir"] = state["finetuned_dir"]
            row["distill"] = state.get("finetune", {}).get("distill")
            row["finetune_tokens"] = state.get("finetune", {}).get("tokens")
            row["recovery_curve"] = state.get("finetune", {}).get("recovery_curve")
            del tuned
        final = row.get("finetuned", row["pruned"])
        row["params"] = final["params"]
        row["perplexity"] = final["perplexity"]
        results["arms"].append(row)
        release()
    to_device(run.base, run.device)
    results["baseline"]["model_dir"] = "base"
    results["run"] = {
        "name": run.recipe.name,
        "device": run.device,
        "eval_split": _eval_split(run),
        "task": "masked-lm" if run.mlm else "causal-lm",
        "train": run.dir.state.get("train"),
        "gqa": _has_gqa(run.base),
    }
    from sinv_prune.lmeval.report import evaluations

    pins = [ev["lm_eval"] for ev in evaluations(results) if ev.get("lm_eval")]
    if pins:  # the same for every model that ran the tasks
        results["run"]["lm_eval"] = pins[0]
    results = with_null_reasons(results)
    write_json(path, results)
    run.dir.finish("evaluate")
    return results


def _has_gqa(model) -> bool:
    """Whether some layer's KV heads serve several query heads (only then does an arm's ``layout`` matter)."""
    from sinv_prune.arch import get_adapter

    adapter = get_adapter(model)
    return any(adapter.layout(i).group_size > 1 for i in range(adapter.num_layers))


def _arm_fields(arm: ArmSpec) -> dict[str, Any]:
    """What an arm removes, for its results row: the single part's keys, or ``parts`` (then the keys are None)."""
    parts = arm.part_specs
    one = parts[0] if arm.parts is None and parts else None
    return {
        "unit": "+".join(arm.units) or "none",
        "parts": [p.model_dump(exclude_none=True) for p in parts] if arm.parts is not None else None,
        "options": one.options if one else None,
        "amount": one.amount if one else None,
        "mode": one.mode if one else None,
        "allocation_strategy": one.allocation if one else None,
        "layout": one.layout if one and "layout" in get_unit(one.unit).recipe_keys else None,
        "seed": one.seed if one else None,
    }


def stage_export(run: Run, results: dict) -> dict:
    """``export.gguf``: the baseline and every arm's final model as ``model.gguf`` (llama.cpp), checked.

    Files go next to each model (``base/model.gguf``, ``arms/NAME/model.gguf``); the summaries
    (size, architecture, round-trip check) go into ``gguf.json`` and the results for the report.
    """
    import json

    from sinv_prune.deploy import export_gguf
    from sinv_prune.deploy.errors import ExportError

    spec = run.recipe.export.gguf if run.recipe.export else None
    path = run.root / "gguf.json"
    if spec is None:
        return results
    if run.dir.done("export"):
        return {**results, "gguf": json.loads(path.read_text())}
    model_spec = run.recipe.model
    source = Path(run.recipe.resolve(model_spec.path)) / model_spec.gguf_file if model_spec.gguf_file else None
    targets = [("baseline", "base", run.base)] + [(row["name"], row["model_dir"], None) for row in results["arms"]]
    out: dict[str, Any] = {}
    for name, model_dir, model in bar(targets, desc="export gguf", unit="file", disable=run.quiet):
        model = model if model is not None else load_saved(run, run.root / model_dir)
        file = (run.root / model_dir).parent / "model.gguf" if name != "baseline" else run.root / "base" / "model.gguf"
        try:
            summary = export_gguf(
                model, run.tokenizer if spec.vocab else None, file, type=spec.type, verify=spec.verify,
                tokenizer_gguf=source if spec.vocab else None, overwrite=True, vocab=spec.vocab,
            )  # fmt: skip
        except ExportError as err:
            raise RunStageError(f"export.gguf ({name}): {err}") from None
        out[name] = {**summary.to_json(), "path": str(file.relative_to(run.root))}
        logger.info("gguf %s: %s", name, str(summary).replace("\n", "; "), extra=CONSOLE)
        if model is not run.base:
            del model
            release()
    write_json(path, out)
    run.dir.finish("export")
    return {**results, "gguf": out}


def _allocation_row(found: dict) -> dict:
    """An arm's allocation for results.json: strategy, parameters, kept widths' range (search: its fitness)."""
    row = {k: found[k] for k in ("units", "strategy", "target_params", "removed_params", "seconds") if k in found}
    row["kept"] = {u: {"min": w["min"], "max": w["max"]} for u, w in found.get("kept", {}).items()}
    if "search" in found:
        row["search"] = {k: found["search"][k] for k in ("seed_fitness", "best_fitness", "evaluations")}
    return row


def stage_report(run: Run, results: dict) -> None:
    write_report(run.root, results, run.recipe, plots=run.recipe.report.plots)
    run.dir.finish("report")


def stage_push(run: Run, results: dict) -> None:
    """Push the chosen arms (each checked by a fresh-process reload first) with a model card."""
    spec = run.recipe.push
    if spec is None or run.dir.done("push"):
        return
    from sinv_prune.hub.push import PushError, push_pruned

    for row in results["arms"]:
        if spec.arms is not None and row["name"] not in spec.arms:
            continue
        state = run.dir.arm(row["name"])
        if state.get("pushed"):
            continue
        repo_id = spec.repo_id.replace("{arm}", _safe(row["name"]))
        try:
            pushed = push_pruned(
                run.root / row["model_dir"],
                repo_id,
                private=spec.private,
                revision=spec.revision,
                overwrite=spec.overwrite,
                results=results,
                recipe_text=recipe_to_yaml(run.recipe),
                arm=row["name"],
            )
        except PushError as err:
            raise RunStageError(f"push: {err}") from None
        state["pushed"] = pushed.url
        run.dir.save()
        logger.info("pushed %s to %s", row["name"], pushed.url)
    run.dir.finish("push")


class RunStageError(ValueError):
    """A stage that cannot go on for a reason the user can fix (one line, CLI exit code 2)."""


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def _log_to_file(path: Path) -> logging.Handler:
    """``run.log``: every sinv_prune line (INFO up) and transformers' warnings (which the console leaves out
    at default verbosity)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("sinv_prune")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    logging.getLogger("transformers").addHandler(handler)
    return handler
