"""The ``sinv-prune`` command line. Thin: parse, call the library, print.

Bad input gives one line on stderr and exit code 2; outputs are written to a
temporary directory and moved into place only when complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from sinv_prune.filemodes import apply_umask
from sinv_prune.version import __version__


class UsageError(click.ClickException):
    """One-line error with exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        from sinv_prune.pipeline.ranks import main_by_env

        if main_by_env():  # under a launcher every process stops with the error; one says it
            click.echo(f"error: {self.message}", err=True)


def _indices(text: str) -> list[int]:
    """``"1,3,8-10"`` -> ``[1, 3, 8, 9, 10]`` (ranges inclusive)."""
    out: list[int] = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        first, dash, last = item.partition("-")
        out.extend(range(int(first), int(last) + 1) if dash and first else [int(item)])
    return out


def parse_heads(text: str, option: str = "--heads") -> dict[int, list[int]]:
    """``"0:1,3;5:0-2"`` or JSON ``{"0": [1, 3], "5": [0, 1, 2]}`` -> ``{0: [1, 3], 5: [0, 1, 2]}``.

    The same form names MLP channels (``--mlp``) and experts (``--experts``); ``a-b`` is the inclusive range.
    """
    text = text.strip()
    try:
        if text.startswith("{"):
            return {int(k): [int(h) for h in v] for k, v in json.loads(text).items()}
        out: dict[int, list[int]] = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            layer, colon, heads = part.partition(":")
            if not colon:
                raise ValueError(part)
            out.setdefault(int(layer), []).extend(_indices(heads))
        return out
    except (ValueError, TypeError, AttributeError, json.JSONDecodeError):
        raise UsageError(f"{option}: cannot parse {text!r}; use '0:1,3;5:0-2' or JSON {{\"0\": [1, 3]}}") from None


def parse_layers(text: str) -> list[int]:
    """``"3,5-7"`` or JSON ``[3, 5, 6, 7]`` -> ``[3, 5, 6, 7]``."""
    text = text.strip()
    try:
        return [int(i) for i in json.loads(text)] if text.startswith("[") else _indices(text)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise UsageError(f"--layers: cannot parse {text!r}; use '3,5-7' or JSON [3, 5]") from None


def read_plan(path: Path) -> dict:
    """A plan file: JSON ``{"heads": {layer: [heads]}, "mlp": {layer: [channels]}, "layers": [blocks]}``."""
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as err:
        raise UsageError(f"--plan: cannot read {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"--plan: {path} is not JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(plan, dict):
        raise UsageError(f'--plan: {path} must hold a JSON object like {{"heads": {{"0": [1]}}, "layers": [3]}}')
    from sinv_prune.units import get_unit, unit_names

    unknown = sorted(set(plan) - set(unit_names()))
    if unknown:
        raise UsageError(f"--plan: {path}: unknown keys {unknown}; expected {', '.join(unit_names())}")
    try:
        out: dict = {}
        for key, value in plan.items():
            if get_unit(key).whole_layers:
                out[key] = [int(i) for i in value]
            else:
                out[key] = {int(k): [int(i) for i in v] for k, v in value.items()}
    except (ValueError, TypeError, AttributeError):
        raise UsageError(f"--plan: {path}: indices must be integers, layers keyed by their number") from None
    return out


class RecipeGroup(click.Group):
    """``sinv-prune RECIPE ...`` is short for ``sinv-prune run RECIPE ...``."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)

    def format_options(self, ctx, formatter) -> None:
        """The group's options and commands, then the run options (the usual way in is ``sinv-prune RECIPE``)."""
        super().format_options(ctx, formatter)
        run_cmd = self.commands["run"]
        help_option = run_cmd.get_help_option(ctx)
        options = [p for p in run_cmd.get_params(ctx) if isinstance(p, click.Option) and p is not help_option]
        rows = [row for param in options if (row := param.get_help_record(ctx))]
        with formatter.section("Run options (sinv-prune RECIPE [OPTIONS], same as sinv-prune run)"):
            formatter.write_dl(rows)


def console_options(result: str, detail: str):
    """``-q`` / ``-v`` of a command that logs and draws progress (:func:`_command_console`); ``result`` says what
    ``-q`` still prints, ``detail`` what ``-v`` adds."""

    def decorate(command):
        quiet = click.option("-q", "--quiet", is_flag=True, help=f"No progress bars or console log; {result}.")
        verbose = click.option("-v", "--verbose", is_flag=True, help=f"Every log line on the console too ({detail}).")
        return quiet(verbose(command))

    return decorate


@click.group(cls=RecipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sinv-prune")
def main() -> None:
    """Find and physically remove attention heads, MLP channels and whole layers from transformers models.

    \b
    sinv-prune [run] RECIPE.yaml -o DIR      run a recipe (train, score, prune, fine-tune, evaluate, report)
    sinv-prune quickstart                    the built-in offline quickstart recipe
    sinv-prune shrink MODEL OUT --params ..  remove a share of the parameters (or --to SIZE): searched cut, refit
    sinv-prune prune MODEL OUT --heads ..    remove given heads / --mlp channels / --experts / --layers (or --plan)
    sinv-prune eval MODEL --tasks ..         zero-shot tasks through lm-evaluation-harness
    sinv-prune export SOURCE OUT.gguf        write a GGUF file for llama.cpp
    sinv-prune info MODEL                    what was removed from a pruned model and how it reloads
    sinv-prune push MODEL --repo-id ..       check that it reloads, then push it (and its GGUF) with a card
    sinv-prune align MODEL -o DIR            symmetry-breaking analysis: tokens aligned with E[b_Q] per head
    """


@main.command()
@click.argument("recipe", default="quickstart")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Run directory (default: runs/NAME).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe value.")
@click.option("--dry-run", is_flag=True, help="Validate, print the plan and a time estimate; run nothing.")
@click.option("--overwrite", is_flag=True, help="Replace an existing run directory.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished stage.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when present).")
@console_options("the summary still prints", "training metrics, transformers' warnings, as in run.log")
@click.option(
    "--threads",
    default="auto",
    show_default=True,
    metavar="auto|N",
    help="CPU threads for torch. auto: from the model's size and the cores free now (small models: 1).",
)
@click.option(
    "--keep-checkpoints", is_flag=True, help="Keep Trainer checkpoints (with optimizer state) after each stage."
)
def run(recipe, output, overrides, dry_run, overwrite, resume, device, quiet, verbose, threads, keep_checkpoints):
    """Run RECIPE (a YAML file or a built-in name) into a run directory."""
    from sinv_prune.pipeline.recipe import RecipeError, load_recipe
    from sinv_prune.pipeline.threads import parse_threads

    try:
        threads = parse_threads(threads)
    except ValueError:
        raise UsageError(f"--threads: expected 'auto' or a positive integer, got {threads!r}") from None
    try:
        parsed = load_recipe(recipe, list(overrides))
    except RecipeError as err:
        raise UsageError(str(err)) from None
    output = output or Path("runs") / parsed.name
    if dry_run:
        _dry_run(parsed, output, device=device, threads=threads)
        return
    _run(
        parsed,
        output,
        overwrite=overwrite,
        resume=resume,
        device=device,
        quiet=quiet,
        verbose=verbose,
        threads=threads,
        keep_checkpoints=keep_checkpoints,
    )


def _experts_text(recipe) -> str:
    """``", 64 experts in 4 MoE layers (top-2)"`` for a mixture-of-experts starting model, else ``""``."""
    from sinv_prune.pipeline.starting_model import meta_adapter

    adapter = meta_adapter(recipe)
    counts = adapter.expert_counts()
    if not counts:
        return ""
    return f", {sum(counts)} experts in {len(counts)} MoE layers (top-{adapter.top_k()})"


def _dry_run(recipe, output: Path, device: str | None = None, threads: int | str | None = "auto") -> None:
    import time

    from sinv_prune.pipeline.preflight import preflight
    from sinv_prune.pipeline.recipe import STAGES, RecipeError

    start = time.perf_counter()
    try:
        layouts = preflight(recipe)
    except RecipeError as err:
        raise UsageError(str(err)) from None
    config_s = time.perf_counter() - start
    heads = sum(lay.num_heads for lay in layouts)
    experts = _experts_text(recipe)
    stages = [s for s in STAGES if s in ("score", "prune", "evaluate", "report") or getattr(recipe, s, None)]
    click.echo(f"recipe {recipe.name!r} is valid; output: {output}")
    click.echo(f"model: {len(layouts)} layers, {heads} heads{experts}; stages: {' -> '.join(stages)}")
    for name in ("train", "finetune"):
        spec = getattr(recipe, name)
        if spec is not None:  # with the optimizer's defaults filled in
            warmup = f", warmup_ratio {spec.warmup_ratio:g}" if spec.warmup_ratio else ""
            order = "" if spec.shuffle else ", blocks in order (shuffle: false)"
            click.echo(f"  {name}: {spec.optimizer}, learning_rate {spec.learning_rate:g}, lr_scheduler "
                       f"{spec.lr_scheduler}{warmup}, optimizer_args {spec.optimizer_args}{order}")  # fmt: skip
    for arm in recipe.prune.arms:
        what = "; ".join(f"{p.criterion} {p.unit}, amount {p.amount}, {p.mode}" for p in arm.part_specs)
        if arm.control:
            what = "prunes nothing (the control: the base, fine-tuned and evaluated like every arm)"
        elif arm.pruned is not None:
            what = f"loads the pruned checkpoint {arm.pruned}"
        elif arm.auto is not None:
            a = arm.auto
            size = (
                f"{a.params:g} of the non-embedding parameters" if a.params is not None else f"to {a.to:,} parameters"
            )
            over = ", ".join(a.units) if a.units else "every unit the model has"
            what = f"shrink {size} over {over}{', stock shapes' if a.stock else ''}, {a.budget} plans"
        click.echo(f"  arm {arm.label}: {what}")
    _print_estimate(recipe, device, config_s, threads)
    _print_memory(recipe, device)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        click.echo(f"warning: {output} exists; the run needs --overwrite (start again) or --resume (continue it)")


def _print_estimate(recipe, device: str | None, config_s: float, threads: int | str | None) -> None:
    """Per-stage time estimate from a short probe (a few seconds) of the model on the run's device.

    The probe runs with the torch threads the run itself would choose.
    """
    from sinv_prune.pipeline.device_choice import default_device
    from sinv_prune.pipeline.estimate import estimate_stages, estimate_table, run_probe, split_tokens
    from sinv_prune.pipeline.threads import recipe_threads

    device = default_device(device, recipe.device)
    click.echo(f"probing {device} for a time estimate ...")
    try:
        with recipe_threads(recipe, threads):
            probe = run_probe(recipe, device, config_s=config_s)
    except (RuntimeError, AssertionError, OSError, ValueError) as err:  # e.g. --device cuda on a CPU-only torch
        click.echo(f"warning: no time estimate, the probe failed on {device}: {_one_line(err)}")
        return
    tokens = split_tokens(recipe)
    click.echo(estimate_table(estimate_stages(recipe, probe, tokens), probe))
    if not tokens:
        click.echo("note: the corpus (a Hub dataset) is not read before the run: stages sized by it count as empty")


def _print_memory(recipe, device: str | None) -> None:
    """The prune stage's predicted peak memory (:mod:`sinv_prune.pipeline.memory_model`); a run that will not fit
    the device is refused (exit 2) in one line naming the setting that would."""
    from sinv_prune.pipeline.device_choice import default_device
    from sinv_prune.pipeline.estimate import memory_check

    device = default_device(device, recipe.device)
    try:
        lines, refused = memory_check(recipe, device)
    except Exception as err:  # noqa: BLE001  (an architecture the memory model cannot read: the dry run goes on)
        click.echo(f"warning: no memory estimate: {_one_line(err)}")
        return
    for line in lines:
        click.echo(line)
    if refused:
        raise UsageError(refused)


def _run(recipe, output: Path, *, verbose: bool = False, **kwargs) -> None:
    from sinv_prune.pipeline.ranks import main_by_env
    from sinv_prune.pipeline.recipe import RecipeError
    from sinv_prune.pipeline.stages import RunStageError, run_recipe
    from sinv_prune.rundir import RunDirError

    main = main_by_env()  # under torchrun / accelerate launch only the main process prints and cleans up
    fresh = main and not output.exists()
    quiet = kwargs["quiet"] = kwargs["quiet"] or not main
    try:
        with _command_console(quiet=quiet, verbose=verbose):
            results = run_recipe(recipe, output, **kwargs)
    except (RunStageError, FloatingPointError) as err:  # FloatingPointError: training diverged (ECD's NaN limit)
        raise UsageError(_one_line(err)) from None  # finished stages stay for --resume
    except (RecipeError, RunDirError) as err:
        if fresh:
            shutil.rmtree(output, ignore_errors=True)
        raise UsageError(str(err)) from None
    if main:
        _print_summary(results, output)


class _ConsoleFilter:
    """The console's share of the log: warnings, and the INFO lines marked for it (one per finished stage
    or arm, ``extra=CONSOLE`` in the pipeline); every line with ``-v``."""

    def __init__(self, verbose: bool):
        self.verbose = verbose

    def filter(self, record) -> bool:
        import logging

        return self.verbose or record.levelno >= logging.WARNING or getattr(record, "console", False)


@contextlib.contextmanager
def _command_console(*, quiet: bool, verbose: bool):
    """The console of a long command (``run``, ``eval``): its log lines (:func:`_console`) and its progress.

    Progress bars on a terminal (or with ``-v``); in a log or a pipe they would be thousands of redraws,
    so there a long loop writes a note line now and then instead; ``quiet``: neither.
    """
    from sinv_prune.progress import progress_mode

    mode = "off" if quiet else "bars" if verbose or sys.stderr.isatty() else "notes"
    with _console(quiet=quiet, verbose=verbose), progress_mode(mode):
        yield


@contextlib.contextmanager
def _console(*, quiet: bool, verbose: bool):
    """Console logging for a run: nothing but errors with ``quiet``; stage lines by default; all with ``-v``.

    transformers' own warnings and progress bars (loading, saving) leave the console unless ``-v``;
    its warnings still reach ``run.log``. lm-eval's log lines, prints and bars only with ``-v``
    (:func:`sinv_prune.lmeval.harness.lm_eval_chatty`).
    """
    import logging

    from transformers.utils import logging as hf_logging

    log, lm_eval = logging.getLogger("sinv_prune"), logging.getLogger("lm_eval")
    handler, lm_eval_level = None, lm_eval.level
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.set_verbosity_error()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_ConsoleFilter(verbose))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        if verbose:
            lm_eval.addHandler(handler)
            lm_eval.setLevel(logging.INFO)
    if quiet or not verbose:
        hf_logging.disable_default_handler()
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
            lm_eval.removeHandler(handler)
            lm_eval.setLevel(lm_eval_level)
        if quiet or not verbose:
            hf_logging.enable_default_handler()
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


def _print_summary(results: dict, output: Path) -> None:
    """The summary table: a rich table on a terminal; a plain one, never truncated, in a log or pipe."""
    from rich.console import Console
    from rich.table import Table

    from sinv_prune.pipeline.report import format_cell, plain_table, summary_rows

    rows = summary_rows(results)
    if not sys.stdout.isatty():
        click.echo(f"sinv-prune: {output}")
        click.echo(plain_table(rows))
        click.echo(f"report: {output / 'report.md'}   results: {output / 'results.json'}")
        return
    table = Table(title=f"sinv-prune: {output}", title_justify="left")
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("arm", "criterion") else "right")
    for row in rows:
        table.add_row(*(format_cell(v) for v in row.values()))
    console = Console()
    console = Console(width=max(console.width, 120))  # one row per arm, unwrapped, also in logs
    console.print(table)
    console.print(f"report: {output / 'report.md'}   results: {output / 'results.json'}")


def offload_options(command):
    """``--offload none|cpu|disk`` and ``--offload-folder``, shared by ``prune`` and ``shrink``."""
    command = click.option(
        "--offload-folder",
        type=click.Path(path_type=Path),
        default=None,
        help="Where --offload disk writes the cut weights (default: a temporary folder next to OUTPUT, removed "
        "after saving); safetensors checkpoints are read in place.",
    )(command)
    return click.option(
        "--offload",
        type=click.Choice(["none", "cpu", "disk"]),
        default="none",
        show_default=True,
        help="Keep the transformer blocks in host RAM (cpu) or on disk and bring one at a time to the GPU "
        "(accelerate's offload hooks); the model is never whole on the GPU (disk: nor in RAM).",
    )(command)


@contextlib.contextmanager
def _offload_folder(offload: str, folder: Path | None, output: Path):
    """The offload folder to use: ``folder``, or for disk offload a temporary one next to ``output``, removed after."""
    if offload != "disk" or folder is not None:
        if folder is not None and offload != "disk":
            raise UsageError("--offload-folder is only used with --offload disk")
        yield folder
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    made = Path(tempfile.mkdtemp(prefix=f".{output.name}.offload.", dir=output.parent))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


@main.command()
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--heads", default=None, help="Query heads to remove per layer: '0:1,3;5:0' or JSON {\"0\": [1, 3]}.")
@click.option(
    "--mlp",
    default=None,
    help="MLP channels to remove per layer: '0:0-127;3:5,9' or JSON (MoE layers: expert e's channel c is e*I+c).",
)
@click.option("--layers", default=None, help="Whole blocks to remove: '3,5-7' or JSON [3, 5].")
@click.option("--experts", default=None, help="Routed experts to remove per MoE layer: '0:1,5;2:3' or JSON.")
@click.option(
    "--plan",
    "plan_file",
    default=None,
    type=click.Path(path_type=Path),
    help='The whole plan as JSON: {"heads": {"0": [1]}, "mlp": {"2": [0, 1]}, "layers": [3]}.',
)
@click.option("--gguf-file", default=None, help="Load SOURCE/GGUF_FILE (a GGUF checkpoint).")
@click.option("--allow-empty-layers", is_flag=True, help="Allow removing every head of a layer.")
@offload_options
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--dry-run", is_flag=True, help="Print the predicted peak memory (from the config alone); run nothing.")
def prune(
    source: str,
    output: Path,
    heads: str | None,
    mlp: str | None,
    layers: str | None,
    experts: str | None,
    plan_file: Path | None,
    gguf_file: str | None,
    allow_empty_layers: bool,
    offload: str,
    offload_folder: Path | None,
    overwrite: bool,
    dry_run: bool,
):
    """Remove heads, MLP channels, experts and/or whole layers from the model at SOURCE; save it to OUTPUT.

    Every index is in the model's numbering now (as sinv-prune info shows it); heads and channels
    are cut first, then blocks dropped, in one call of sinv_prune.prune.
    """
    from sinv_prune.surgery.checkpoint import from_pretrained
    from sinv_prune.surgery.removal import prune as prune_plan

    if plan_file is not None and (heads or mlp or layers or experts):
        raise UsageError("--plan holds the whole plan; do not combine it with --heads, --mlp, --experts or --layers")
    if plan_file is not None:
        request = read_plan(plan_file)
    else:
        request = {"heads": parse_heads(heads)} if heads else {}
        if mlp:
            request["mlp"] = parse_heads(mlp, "--mlp")
        if experts:
            request["experts"] = parse_heads(experts, "--experts")
        if layers:
            request["layers"] = parse_layers(layers)
    if not any(request.values()):
        raise UsageError("nothing to remove: give --heads, --mlp, --experts, --layers or --plan FILE.json")
    if output.exists() and not overwrite and not dry_run:
        raise UsageError(f"{output} exists; pass --overwrite to replace it")
    source = _model_source(source, gguf_file)
    _memory_check(source, gguf_file, "plain", dry_run=dry_run, offload=offload)
    if dry_run:
        return
    with _offload_folder(offload, offload_folder, output) as folder:
        try:
            load = {"gguf_file": gguf_file} if gguf_file else {}
            model = from_pretrained(source, offload=offload, offload_folder=folder, **load)
            summary = prune_plan(model, request, allow_empty_layers=allow_empty_layers)
        except (OSError, ValueError) as err:
            # The library names its keyword argument; here the user typed a flag.
            raise UsageError(_one_line(err).replace("allow_empty_layers=True", "--allow-empty-layers")) from None
        tokenizer = _load_tokenizer(source, gguf_file)
        _save_atomically(
            output, overwrite, lambda d: (model.save_pretrained(d), tokenizer and tokenizer.save_pretrained(d))
        )
    click.echo(str(summary))
    click.echo(f"saved to {output}" + ("" if tokenizer else " (no tokenizer found at the source)"))


def _memory_check(source: str, gguf_file: str | None, task: str, *, dry_run: bool, sequences: int = 0,
                  length: int = 0, device: str = "cpu", offload: str = "none", **options) -> None:  # fmt: skip
    """Predict the run's peak memory from SOURCE's config (no weight read) and refuse, exit 2 with one line
    naming the option that would fit, a run the device (here the CPU: the host's available memory) cannot
    hold; with ``dry_run`` also print the prediction. ``SINV_PRUNE_NO_MEMORY_CHECK=1`` skips the refusal
    of a real run (the prediction errs high where its round constants do)."""
    from sinv_prune.pipeline.memory_model import dry_run_check, gib, shape_of_source

    if not dry_run and os.environ.get("SINV_PRUNE_NO_MEMORY_CHECK"):
        return
    try:
        shape = shape_of_source(source, gguf_file)
    except (OSError, ValueError) as err:
        if dry_run:
            raise UsageError(f"{source}: cannot read its config ({_one_line(err)})") from None
        return  # the load itself says what is wrong
    lines, refused = dry_run_check(shape, task, device, sequences=sequences, length=length, offload=offload,
                                   offload_option="--offload {}", **options)  # fmt: skip
    if dry_run:
        click.echo(f"{source}: {shape.layers} layers, {gib(shape.model_bytes)} of weights")
        for line in lines:
            click.echo(line)
    if refused:
        raise UsageError(refused)


def parse_size(text: str) -> int:
    """A parameter count: ``100M``, ``1.5B``, ``250k`` or plain digits."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
    t = text.strip().lower().replace("_", "").replace(",", "")
    try:
        value = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise UsageError(f"--to {text!r}: not a size (write 100M, 1.5B, 250k or a number)") from None
    if not math.isfinite(value) or value < 1:
        raise UsageError(f"--to {text!r}: a size must be a positive number of parameters")
    return int(value)


@main.command()
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--params", type=float, default=None, help="Share of the non-embedding parameters to remove (0-1).")
@click.option("--to", "to", default=None, metavar="SIZE", help="Parameters to end with, in all: 100M, 1.5B, ...")
@click.option(
    "--calibration",
    required=True,
    metavar="TEXT",
    help="Calibration text: a .txt file, a directory of them, or a datasets id (name[:config[:split]]).",
)
@click.option("--sequences", default=64, show_default=True, type=click.IntRange(2), help="Calibration sequences.")
@click.option("--length", default=512, show_default=True, type=click.IntRange(2), help="Tokens per sequence.")
@click.option("--stock", is_flag=True, help="Only shapes the stock class and vLLM load (uniform per unit).")
@click.option(
    "--units",
    default=None,
    help="Units the search may cut, comma-separated, among layers, heads, mlp, "
    "experts [default: every unit the model has; mlp (dense layers) and experts (MoE layers) always].",
)
@click.option("--budget", default=48, show_default=True, type=click.IntRange(1), help="Plans evaluated by the search.")
@click.option("--time-limit", type=click.FloatRange(0, min_open=True), default=None, help="Stop searching after S s.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the search (same seed, same plan).")
@click.option("--statistics-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float64"]),
              help="Dtype the per-layer calibration statistics are kept in (on the host).")  # fmt: skip
@click.option(
    "--refine",
    is_flag=True,
    help="Also build the plan block by block (OBS, each refit to the unpruned residual stream) and keep it where "
    "held-out perplexity is lower; a copy of the model.",
)
@click.option("--gguf", "gguf_type", default=None, type=click.Choice(["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m",
              "q5_k_m", "q6_k"]), help="Also write OUTPUT/model.gguf of this type (checked in llama.cpp).")  # fmt: skip
@click.option("--gguf-file", default=None, help="Load SOURCE/GGUF_FILE (a GGUF checkpoint).")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="PATH", help="Tokenizer (default: SOURCE's).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@offload_options
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--dry-run", is_flag=True, help="Print the predicted peak memory (from the config alone); run nothing.")
def shrink(source, output, params, to, calibration, sequences, length, stock, units, budget, time_limit, seed,
           statistics_dtype, refine, gguf_type, gguf_file, tokenizer_path, quiet, offload, offload_folder, overwrite,
           dry_run):  # fmt: skip
    """Remove --params of SOURCE's non-embedding parameters (or shrink it --to a size) by a joint search over
    whole layers, query heads / KV groups and MLP channels; save the result to OUTPUT with shrink.json.

    Each candidate plan is built with OBS selection and a guarded refit in every layer and scored by its
    KL to the unpruned model on held-out calibration tokens; the best seed (uniform single-unit cuts) is
    the floor. See docs/api.md (shrink).
    """
    from sinv_prune.shrink.command import run_shrink

    if (params is None) == (to is None):
        raise UsageError("give exactly one of --params SHARE and --to SIZE")
    if output.exists() and not overwrite and not dry_run:
        raise UsageError(f"{output} exists; pass --overwrite to replace it")
    size = parse_size(to) if to is not None else None
    source = _model_source(source, gguf_file)
    if refine and offload != "none":
        raise UsageError("--refine builds a copy of the model; it cannot run with --offload (use --offload none)")
    _memory_check(source, gguf_file, "shrink", dry_run=dry_run, sequences=sequences, length=length, offload=offload,
                  refine=refine)  # fmt: skip
    if dry_run:
        return
    chosen = None if units is None else tuple(u.strip() for u in units.split(",") if u.strip())
    with _offload_folder(offload, offload_folder, output) as folder:
        try:
            result = run_shrink(
                source, output, params=params, to=size, calibration=calibration, sequences=sequences, length=length,
                stock=stock, units=chosen, budget=budget,
                time_limit=time_limit, seed=seed, statistics_dtype=statistics_dtype, refine=refine, gguf_type=gguf_type,
                gguf_file=gguf_file, tokenizer_path=tokenizer_path, quiet=quiet, overwrite=overwrite,
                save=_save_atomically, offload=offload, offload_folder=folder,
            )  # fmt: skip
        except (OSError, ValueError, ImportError) as err:
            raise UsageError(_one_line(err)) from None
    click.echo(str(result))
    click.echo(f"saved to {output}")


@main.command()
@click.argument("source")
def info(source: str) -> None:
    """Show what was removed from the pruned model at SOURCE and how it reloads.

    \b
    SOURCE is one of (as for push)
      RUN_DIR/ARM_NAME        an arm of a recipe run, by the name in its results
      RUN_DIR/arms/DIR        an arm directory (its fine-tuned model if any, else the pruned one)
      MODEL_DIR               any checkpoint directory, e.g. RUN_DIR/arms/DIR/pruned
    """
    from transformers import AutoConfig

    from sinv_prune.surgery.record import get_record
    from sinv_prune.units import units

    path = _model_source(source)
    try:
        config = AutoConfig.from_pretrained(path)
        record = get_record(config)
    except (OSError, ValueError) as err:
        raise UsageError(_one_line(err)) from None
    if record is None:
        click.echo(f"{path}: not pruned by sinv_prune ({config.model_type})")
        return
    route = (
        "stock class, no remote code" if record.stock_layout else "sinv_prune.from_pretrained or trust_remote_code=True"
    )
    click.echo(f"{path}: {record.base_class}, {record.num_layers} layers x {record.num_heads} heads ({route})")
    kinds = units()  # whole-layer units first: a removed block's line says only that
    for layer in range(record.num_layers):
        gone = next((text for kind in kinds if kind.whole_layers and (text := kind.info(record, layer))), "")
        text = gone or "".join(kind.info(record, layer) for kind in kinds if not kind.whole_layers)
        click.echo(f"  layer {layer:>3}: {text}")


def _model_source(source: str, gguf_file: str | None = None) -> str:
    """The checkpoint SOURCE names, in any form ``push`` takes (RUN_DIR/ARM_NAME, RUN_DIR/arms/DIR, a
    checkpoint directory), as :func:`sinv_prune.hub.push.resolve_source` finds it; other names are Hub ids."""
    from sinv_prune.hub.push import PushError, resolve_source

    path = Path(source)
    if gguf_file or path.is_file() or (path / "config.json").is_file():
        return source
    if not path.exists() and not (path.parent / "arms").is_dir():
        looks_local = os.path.isabs(source) or source.startswith(".") or source.count("/") != 1
        if looks_local:
            raise UsageError(f"{source}: no such model directory or Hub id")
        return source
    try:
        return str(resolve_source(path).model_dir)
    except PushError as err:
        raise UsageError(str(err)) from None


def _load_tokenizer(source: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    from sinv_prune.surgery.keep_tokenizer import has_tokenizer

    local = Path(source)
    if local.is_dir() and not gguf_file and not has_tokenizer(local):
        return None  # transformers would build an empty tokenizer here
    try:
        return AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError):
        return None


def _save_atomically(output: Path, overwrite: bool, write) -> None:
    """Write into a sibling temp dir, then move it into place; nothing half-written remains."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        write(tmp)
        apply_umask(tmp)
        if output.exists() and overwrite:
            shutil.rmtree(output) if output.is_dir() else output.unlink()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


@main.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--repo-id", required=True, metavar="USER/NAME", help="Hub repo to push to (NAME alone: your user).")
@click.option("--private", is_flag=True, help="Create the repo private (default: the namespace's default).")
@click.option("--revision", default=None, metavar="BRANCH", help="Branch to push to (created from main if missing).")
@click.option("--overwrite", is_flag=True, help="Push into an existing repo, replacing its files.")
@click.option("--commit-message", default=None, help="Commit message (default: 'Upload pruned model ...').")
def push(source: Path, repo_id: str, private: bool, revision, overwrite: bool, commit_message) -> None:
    """Check that SOURCE reloads in a fresh process, then push it with a model card to the Hub.

    \b
    SOURCE is one of
      RUN_DIR/ARM_NAME        an arm of a recipe run, by the name in its results
      RUN_DIR/arms/DIR        an arm directory (its fine-tuned model if any, else the pruned one)
      MODEL_DIR               any checkpoint directory, e.g. RUN_DIR/arms/DIR/pruned
    The card uses the run's results.json and recipe.yaml when SOURCE is part of a run. GGUF files
    go too: those inside the checkpoint (shrink --gguf), and the one the run's export.gguf wrote of
    this model (RUN_DIR/arms/DIR/model.gguf); the card names each with its type and the llama.cpp commands.
    The token comes from HF_TOKEN or `hf auth login`, never from a recipe; HF_ENDPOINT picks the server.
    """
    import logging

    from sinv_prune.hub.push import PushError, push_pruned, resolve_source

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("sinv_prune")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        found = resolve_source(source)
        what = f" (run {found.run_dir}, arm {found.arm})" if found.arm else ""
        click.echo(f"pushing {found.model_dir}{what} to {repo_id}")
        result = push_pruned(
            found.model_dir,
            repo_id,
            private=private,
            revision=revision,
            overwrite=overwrite,
            results=found.results,
            recipe_text=found.recipe_text,
            arm=found.arm,
            stage=found.stage,
            commit_message=commit_message,
        )
    except PushError as err:
        raise UsageError(str(err)) from None
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    gone = f", deleted {len(result.deleted)} stale" if result.deleted else ""
    click.echo(f"pushed {len(result.files)} files{gone} to {result.url} ({result.revision}): {result.commit_url}")


@main.command(name="eval")
@click.argument("source")
@click.option(
    "--tasks",
    default="",
    metavar="T1,T2,..",
    help="lm-eval task names, wikitext_lastword (offline, shipped) or directories of task YAML files.",
)
@click.option("--limit", type=float, default=None, metavar="N", help="Items per task (below 1: a fraction).")
@click.option("--num-fewshot", type=click.IntRange(0), default=0, show_default=True, help="Few-shot examples.")
@click.option("--batch-size", default="auto", show_default=True, metavar="auto|N", help="lm-eval's batch size.")
@click.option("--perplexity", is_flag=True, help="Also the WikiText-2 test perplexity (SINV_PRUNE_WIKITEXT).")
@click.option("--max-tokens", type=click.IntRange(2), default=None, help="Perplexity on the first N tokens only.")
@click.option("--gguf-file", default=None, help="Load SOURCE/GGUF_FILE (a GGUF checkpoint).")
@click.option("--tokenizer", default=None, metavar="PATH", help="Tokenizer directory, Hub id or .gguf file.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when present).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write each task's metrics to FILE.")
@click.option("--overwrite", is_flag=True, help="Replace the --json FILE if it exists.")
@console_options("the results still print", "transformers' warnings, lm-eval's log lines and prints")
def eval_(source, tasks, limit, num_fewshot, batch_size, perplexity, max_tokens, gguf_file, tokenizer, device,
          json_path, overwrite, quiet, verbose):  # fmt: skip
    """Zero-shot tasks (lm-evaluation-harness) on the model at SOURCE: a checkpoint directory, Hub id or GGUF file."""
    from sinv_prune.lmeval.harness import TasksError, make_table, require_lm_eval
    from sinv_prune.pipeline.eval_command import evaluate_source

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names and not perplexity:
        raise UsageError("give --tasks (comma-separated) and/or --perplexity")
    try:
        if names:
            require_lm_eval()
    except TasksError as err:
        raise UsageError(f"--tasks: {err}") from None
    if batch_size != "auto" and not (batch_size.isdigit() and int(batch_size) > 0):
        raise UsageError(f"--batch-size: expected 'auto' or a positive integer, got {batch_size!r}")
    if limit is not None and (limit <= 0 or (limit >= 1 and not limit.is_integer())):
        raise UsageError(f"--limit: expected a positive count or a fraction below 1, got {limit:g}")
    if json_path is not None and json_path.exists() and not overwrite:
        raise UsageError(f"{json_path} exists; pass --overwrite to replace it")
    source = _model_source(source, gguf_file)
    try:
        with _command_console(quiet=quiet, verbose=verbose):
            out = evaluate_source(
                source, names, gguf_file=gguf_file, limit=int(limit) if limit and limit >= 1 else limit,
                num_fewshot=num_fewshot, batch_size=batch_size, device=device, perplexity=perplexity,
                max_tokens=max_tokens, tokenizer=tokenizer,
            )  # fmt: skip
    except (TasksError, OSError, ValueError) as err:
        raise UsageError(_one_line(err)) from None
    if "raw" in out:
        click.echo(make_table({"lm_eval": out["raw"]}))
    if "perplexity" in out:
        ppl = out["perplexity"]
        click.echo(f"WikiText-2 test perplexity: {ppl['perplexity']:.3f} ({ppl['tokens']:,} tokens, windows of "
                   f"{ppl['seq_len']}, stride {ppl['stride']})")  # fmt: skip
    if json_path is not None:
        from sinv_prune.rundir import write_json

        write_json(json_path, {k: v for k, v in out.items() if k != "raw"})
        click.echo(f"wrote {json_path}")


@main.command("export")
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--type",
    "type_",
    default="f16",
    show_default=True,
    type=click.Choice(["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"]),
    help="GGUF storage type of the weights.",
)
@click.option("--gguf-file", default=None, help="Load SOURCE/GGUF_FILE (a GGUF checkpoint).")
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    metavar="PATH",
    help="Tokenizer directory, Hub id or .gguf file (default: the model's own, its run's, or its source GGUF).",
)
@click.option("--no-vocab", is_flag=True, help="Write a vocabulary-free file (token ids in, logits out).")
@click.option(
    "--verify/--no-verify",
    default=None,
    help="Compare llama.cpp's logits with transformers' (default: when llama-cpp-python is installed).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
def export(source: str, output: Path, type_: str, gguf_file: str | None, tokenizer_path: str | None, no_vocab: bool,
           verify: bool | None, overwrite: bool):  # fmt: skip
    """Write the model at SOURCE as one GGUF file OUTPUT that llama.cpp runs (any per-layer shape it can express).

    \b
    SOURCE is one of (as for push), or a Hub id or a .gguf file
      RUN_DIR/ARM_NAME        an arm of a recipe run, by the name in its results
      RUN_DIR/arms/DIR        an arm directory (its fine-tuned model if any, else the pruned one)
      MODEL_DIR               any checkpoint directory, e.g. RUN_DIR/arms/DIR/pruned
    The tokenizer is copied from the GGUF file the model (or its run) was loaded from, else built
    from the checkpoint's (or its run's) transformers tokenizer, else from --tokenizer; with none of
    these the export stops (--no-vocab writes a file without one). The file is checked in llama.cpp
    before it is moved into place: a float32 file that does not match leaves nothing behind.
    """
    from sinv_prune.deploy import export_gguf
    from sinv_prune.deploy.errors import ExportError
    from sinv_prune.hub.push import run_of_model
    from sinv_prune.surgery.checkpoint import from_pretrained

    if output.exists() and not overwrite:
        raise UsageError(f"{output} exists; pass --overwrite to replace it")
    if no_vocab and tokenizer_path:
        raise UsageError("--tokenizer and --no-vocab exclude each other")
    path = _model_source(source, gguf_file)
    local = Path(path)
    run = run_of_model(local) if (local / "config.json").is_file() else None
    try:
        model = from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {})).eval()
    except (OSError, ValueError) as err:
        raise UsageError(_one_line(err)) from None
    tokenizer, tokenizer_gguf = (None, None) if no_vocab else _export_tokenizer(model, path, gguf_file, run,
                                                                                 tokenizer_path)  # fmt: skip
    try:
        result = export_gguf(
            model, tokenizer, output, type=type_, verify=verify, overwrite=overwrite, tokenizer_gguf=tokenizer_gguf,
            vocab=not no_vocab,
        )  # fmt: skip
    except (ExportError, ImportError) as err:
        raise UsageError(_one_line(err)) from None
    click.echo(str(result))


def _export_tokenizer(model, path: str, gguf_file: str | None, run: Path | None, explicit: str | None):
    """(transformers tokenizer, GGUF file to copy the tokenizer keys from) for ``sinv-prune export``."""
    from sinv_prune.data import load_model_tokenizer
    from sinv_prune.deploy.sources import run_gguf_source, tokenizer_dir

    local = Path(path)
    try:
        if explicit:
            if explicit.endswith(".gguf") and Path(explicit).is_file():
                return load_model_tokenizer(explicit), explicit
            return load_model_tokenizer(explicit), None
        source_gguf = None if getattr(model, "sinv_gguf_source", None) else run_gguf_source(run)
        tok_source = tokenizer_dir(local, run) if local.is_dir() and not gguf_file else None
        if tok_source is not None:
            return load_model_tokenizer(str(tok_source)), source_gguf
        if gguf_file or local.suffix == ".gguf":
            return load_model_tokenizer(path, gguf_file=gguf_file), source_gguf
        if not local.exists():  # a Hub id
            return _load_tokenizer(path, None), source_gguf
    except (OSError, ValueError) as err:
        where = f"--tokenizer {explicit}" if explicit else path
        raise UsageError(f"cannot load the tokenizer from {where}: {_one_line(err)}") from None
    if source_gguf is None:
        raise UsageError(
            f"{path} has no tokenizer: pass --tokenizer PATH (the directory or .gguf file it came from), "
            "or --no-vocab for a vocabulary-free file"
        )
    return None, source_gguf


@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Directory for the report.")
@click.option("--layer", "layers", multiple=True, type=int, help="Layer to analyse (repeatable; default all).")
@click.option("--top-k", default=10, show_default=True, type=click.IntRange(1), help="Tokens per side per head.")
@click.option("--gguf-file", default=None, help="Load MODEL/GGUF_FILE (a GGUF checkpoint).")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
def align(model: str, output: Path, layers: tuple[int, ...], top_k: int, gguf_file: str | None, overwrite: bool):
    """Tokens whose keys align most and least with E[b_Q], per head (symmetry-breaking analysis)."""
    from sinv_prune.pipeline.report_alignment import alignment_report

    if output.exists() and not overwrite:
        raise UsageError(f"{output} exists; pass --overwrite to replace it")
    model = _model_source(model, gguf_file)
    try:
        out = alignment_report(
            model, output, layer=list(layers) or None, top_k=top_k,
            load_kwargs={"gguf_file": gguf_file} if gguf_file else None,
        )  # fmt: skip
    except (OSError, ValueError) as err:
        raise UsageError(_one_line(err)) from None
    if out["summary"].get("note"):
        click.echo(out["summary"]["note"])
    click.echo(f"wrote {out['markdown']}, {out['json']}" + (f", {out['png']}" if out.get("png") else ""))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
