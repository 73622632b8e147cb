"""The fine-tune's training blocks: from the run's train split, or streamed from any ``datasets`` source.

* :func:`stream_rows` opens ``finetune.data`` (local text files, a directory of them, a Hub dataset id
  with config, split and text column, or a local dataset directory through the same call) with
  ``datasets.load_dataset(..., streaming=True)``;
* :func:`pack_rows` tokenises the rows one by one (the separator rule of
  :func:`sinv_prune.data.token_ids`) and packs them into consecutive ``seq_len`` blocks;
* :func:`stream_blocks` takes the first ``n`` blocks of the stream onto disk once per run (an int32
  ``.npy`` file written and read memory-mapped, so a large budget never sits in memory whole), so every
  arm, every epoch and every process sees the same blocks in the same order;
* :class:`Blocks` is the ``torch`` dataset the Trainer reads: ``input_ids`` and the block's ``index``
  (which the cached distillation looks its teacher rows up by; the Trainer drops it otherwise).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from sinv_prune.data import encode_lines, encodes_newline
from sinv_prune.strict_json import dumps

logger = logging.getLogger("sinv_prune")
#: Rows tokenised at once while packing.
ENCODE_BATCH = 256


class Blocks(torch.utils.data.Dataset):
    """Fixed-length token blocks (``[n, seq_len]``, a tensor or a memory-mapped array) as Trainer examples."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def seq_len(self) -> int:
        return int(self.blocks.shape[1])

    def __getitem__(self, i: int) -> dict:
        row = self.blocks[i]
        row = row.long() if isinstance(row, torch.Tensor) else torch.from_numpy(np.array(row, dtype=np.int64))
        return {"input_ids": row, "index": int(i)}


def stream_rows(spec, resolve=str):
    """The rows' text of ``finetune.data`` (:class:`~sinv_prune.pipeline.recipe.FinetuneData`), in order.

    ``files``: ``datasets.load_dataset("text", data_files=[...], split="train", streaming=...)``, one row a
    line, files in the order given (a directory: its ``*.txt`` in name order). ``hub``:
    ``datasets.load_dataset(path, name, split=split, streaming=...)`` and its ``text_column`` (a local
    directory of data files works here too: ``datasets`` infers its builder). ``resolve`` maps a recipe
    path to a real one.
    """
    import datasets

    if spec.files is not None:
        files = []
        for given in [spec.files] if isinstance(spec.files, str) else spec.files:
            path = Path(resolve(given))
            if path.is_dir():
                found = sorted(path.glob("*.txt"))
                if not found:
                    raise FileNotFoundError(f"finetune.data.files: no *.txt file in {path}")
                files += found
            elif path.is_file():
                files.append(path)
            else:
                raise FileNotFoundError(f"finetune.data.files: {path} does not exist")
        loaded = datasets.load_dataset(
            "text", data_files=[str(f) for f in files], split="train", streaming=spec.streaming
        )
        column = "text"
    else:
        hub = spec.hub
        path = resolve(hub.path) if Path(resolve(hub.path)).exists() else hub.path
        loaded = datasets.load_dataset(path, hub.name, split=hub.split, streaming=spec.streaming)
        column = hub.text_column
    for row in loaded:
        if column not in row:
            raise ValueError(f"finetune.data: the rows have no column {column!r} (columns: {', '.join(row)})")
        yield row[column]


def pack_rows(rows: Iterable[str], tokenizer, seq_len: int) -> Iterator[list[int]]:
    """Consecutive blocks of ``seq_len`` token ids from ``rows``; the remainder after the last block is dropped.

    Where the tokenizer encodes ``"\\n"`` each row is encoded followed by a newline (the text file's own
    text); otherwise each non-blank row is followed by the EOS token (as ``token_ids(separator="auto")``).
    """
    newline = encodes_newline(tokenizer)
    if not newline and tokenizer.eos_token_id is None:
        raise ValueError("finetune.data: the tokenizer encodes no newline and has no EOS token to separate rows")
    buffer: list[int] = []
    batch: list[str] = []

    def flush() -> Iterator[list[int]]:
        texts = [t + "\n" for t in batch] if newline else [t for t in batch if t.strip()]
        for ids in encode_lines(texts, tokenizer) if texts else []:
            buffer.extend(ids if newline else [*ids, tokenizer.eos_token_id])
        batch.clear()
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            del buffer[:seq_len]

    for text in rows:
        batch.append(text)
        if len(batch) >= ENCODE_BATCH:
            yield from flush()
    yield from flush()


def stream_key(spec, tokenizer, seq_len: int, count: int) -> str:
    """What the packed blocks depend on: the source, the tokenizer's vocabulary, ``seq_len`` and the count."""
    vocab = hashlib.sha256(dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    data = {"source": spec.model_dump(mode="json"), "vocab": vocab, "seq_len": seq_len, "count": count}
    return hashlib.sha256(dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def stream_blocks(spec, tokenizer, seq_len: int, count: int, directory: Path, resolve=str) -> Path:
    """The first ``count`` blocks of the stream as ``directory/KEY/blocks.npy`` (written once; read back after).

    A stream shorter than ``count`` blocks gives what it has (the Trainer then repeats them as epochs);
    none at all is a ``ValueError``.
    """
    from sinv_prune.rundir import write_dir

    target = Path(directory) / stream_key(spec, tokenizer, seq_len, count)
    if (target / "meta.json").is_file():
        return target / "blocks.npy"

    def write(d: Path) -> None:
        # Straight into a memory-mapped file: a large budget never sits in memory whole.
        out = np.lib.format.open_memmap(d / "blocks.npy", mode="w+", dtype=np.int32, shape=(count, seq_len))
        n = 0
        for block in pack_rows(stream_rows(spec, resolve), tokenizer, seq_len):
            out[n] = block
            n += 1
            if n == count:
                break
        out.flush()
        del out
        if n == 0:
            raise ValueError(f"finetune.data: the source makes no block of {seq_len} tokens")
        if n < count:
            logger.info("finetune.data: the stream ends after %d of the %d blocks wanted; they repeat", n, count)
        (d / "meta.json").write_text(dumps({"blocks": n, "seq_len": seq_len, "wanted": count}))

    write_dir(target, write)
    return target / "blocks.npy"


def load_blocks(path: Path) -> Blocks:
    """:class:`Blocks` over a saved ``blocks.npy``, memory-mapped (the blocks the stream filled: ``meta.json``)."""
    filled = json.loads((Path(path).parent / "meta.json").read_text())["blocks"]
    return Blocks(np.load(path, mmap_mode="r")[:filled])


def finetune_blocks(run) -> Blocks:
    """The fine-tune's blocks: ``finetune.data`` streamed (the main process packs, every process reads),
    written by the base model (``generate``: :mod:`sinv_prune.pipeline.teacher_text`) or the run's train split
    (valid without one) cut into ``data.seq_len`` blocks."""
    from sinv_prune.data import block_tensor
    from sinv_prune.pipeline.step_budget import planned_steps

    spec, seq = run.recipe.finetune, run.recipe.data.seq_len
    if spec.data is None:
        (blocks,) = block_tensor(run.ids["train" if "train" in run.ids else "valid"], seq)
        if not len(blocks):
            raise ValueError(f"the fine-tune's split makes no block of {seq} tokens")
        return Blocks(blocks)
    world = run.ranks.world_size
    count = planned_steps(spec, seq, world) * spec.batch_size * spec.gradient_accumulation_steps * world
    if spec.data.generate is not None:
        from sinv_prune.pipeline.teacher_text import generated_blocks

        prompts = run.ids["train" if "train" in run.ids else "valid"]
        path = run.ranks.on_main(lambda: generated_blocks(
            run.base, prompts, spec.data.generate, seq, count, run.root / "finetune_data", seed=run.recipe.seed,
            eos_token_id=run.tokenizer.eos_token_id, progress=not run.quiet))  # fmt: skip
        return load_blocks(path)
    path = run.ranks.on_main(
        lambda: stream_blocks(spec.data, run.tokenizer, seq, count, run.root / "finetune_data", run.recipe.resolve)
    )
    return load_blocks(path)
