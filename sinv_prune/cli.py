"""The ``sinv-prune`` command line. Thin: parse, call the library, print.

Bad input gives one line on stderr and exit code 2; outputs are written to a
temporary directory and moved into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from sinv_prune.version import __version__


class UsageError(click.ClickException):
    """One-line error with exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


def parse_heads(text: str) -> dict[int, list[int]]:
    """``"0:1,3;5:0"`` or JSON ``{"0": [1, 3], "5": [0]}`` -> ``{0: [1, 3], 5: [0]}``."""
    text = text.strip()
    try:
        if text.startswith("{"):
            return {int(k): [int(h) for h in v] for k, v in json.loads(text).items()}
        out: dict[int, list[int]] = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            layer, _, heads = part.partition(":")
            out.setdefault(int(layer), []).extend(int(h) for h in heads.split(",") if h.strip())
        return out
    except (ValueError, TypeError, AttributeError, json.JSONDecodeError):
        raise UsageError(f"--heads: cannot parse {text!r}; use '0:1,3;5:0' or JSON {{\"0\": [1, 3]}}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sinv-prune")
def main() -> None:
    """Find and physically remove attention heads from transformers models."""


@main.command()
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--heads", required=True, help="Heads to remove, current numbering: '0:1,3;5:0' or JSON.")
@click.option("--gguf-file", default=None, help="Load SOURCE/GGUF_FILE (a GGUF checkpoint).")
@click.option("--allow-empty-layers", is_flag=True, help="Allow removing every head of a layer.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
def prune(source: str, output: Path, heads: str, gguf_file: str | None, allow_empty_layers: bool, overwrite: bool):
    """Remove HEADS from the model at SOURCE and save the smaller model to OUTPUT."""
    from sinv_prune.checkpoint import from_pretrained
    from sinv_prune.surgery import prune_heads

    request = parse_heads(heads)
    if output.exists() and not overwrite:
        raise UsageError(f"{output} exists; pass --overwrite to replace it")
    looks_local = os.path.isabs(source) or source.startswith(".") or source.count("/") != 1
    if not Path(source).exists() and looks_local:
        raise UsageError(f"{source}: no such model directory or Hub id")
    try:
        model = from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
        summary = prune_heads(model, request, allow_empty_layers=allow_empty_layers)
    except (OSError, ValueError) as err:
        raise UsageError(_one_line(err)) from None
    tokenizer = _load_tokenizer(source, gguf_file)
    _save_atomically(
        output, overwrite, lambda d: (model.save_pretrained(d), tokenizer and tokenizer.save_pretrained(d))
    )
    click.echo(str(summary))
    click.echo(f"saved to {output}" + ("" if tokenizer else " (no tokenizer found at the source)"))


@main.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
def info(path: Path) -> None:
    """Show what was removed from the pruned checkpoint at PATH and how it reloads."""
    from transformers import AutoConfig

    from sinv_prune.record import get_record

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
    for layer in range(record.num_layers):
        removed = sorted(record.pruned_heads.get(layer, []))
        click.echo(f"  layer {layer:>3}: kept {record.num_heads - len(removed):>3}  removed {removed}")


def _load_tokenizer(source: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    local = Path(source)
    if local.is_dir() and not gguf_file and not any(local.glob("tokenizer*")) and not any(local.glob("vocab*")):
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
        if output.exists() and overwrite:
            shutil.rmtree(output) if output.is_dir() else output.unlink()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
