"""``sinv-prune shrink``: load, shrink, save the model with its tokenizer and ``shrink.json`` (and a GGUF file)."""

from __future__ import annotations

from pathlib import Path

from sinv_prune.shrink.search import ShrinkResult, shrink
from sinv_prune.strict_json import dumps


def run_shrink(source: str, output: Path, *, tokenizer_path: str | None, gguf_file: str | None,
               gguf_type: str | None, overwrite: bool, save, offload: str = "none", offload_folder=None,
               **options) -> ShrinkResult:  # fmt: skip
    """Shrink the model at ``source`` into ``output`` (written through ``save(output, overwrite, write)``, so
    nothing half-written is left); ``options`` go to :func:`~sinv_prune.shrink.shrink`. ``offload`` (none, cpu,
    disk) loads the model with its blocks offloaded (:func:`~sinv_prune.from_pretrained`)."""
    from sinv_prune.data import load_model_tokenizer
    from sinv_prune.surgery.checkpoint import from_pretrained
    from sinv_prune.surgery.offload import check_offload

    check_offload(offload, offload_folder)

    load = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = load_model_tokenizer(tokenizer_path or source, **({} if tokenizer_path else load))
    model = from_pretrained(source, offload=offload, offload_folder=offload_folder, **load).eval()
    source_gguf = str(Path(source) / gguf_file) if gguf_file else (source if source.endswith(".gguf") else None)
    if gguf_type:  # what the export would refuse (type, architecture, vocabulary), before the search
        from sinv_prune.deploy import check_gguf_export

        check_gguf_export(model, tokenizer, type=gguf_type, tokenizer_gguf=source_gguf)
    result = shrink(model, tokenizer=tokenizer, offload=offload, offload_folder=offload_folder, **options)

    def write(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        (directory / "shrink.json").write_text(dumps(result.to_dict()) + "\n")
        if gguf_type:
            from sinv_prune.deploy import export_gguf

            export_gguf(model, tokenizer, directory / "model.gguf", type=gguf_type, tokenizer_gguf=source_gguf)

    save(output, overwrite, write)
    return result
