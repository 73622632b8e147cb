"""Training text the unpruned model writes itself: ``finetune.data: {generate: {...}}``.

Distillation needs text on which the teacher's distribution is worth copying, and as much of it as the
budget asks for. Where the only text is a small file (WikiText-2's valid.txt on these machines: 274k tokens
against a 0.5M-token budget, read twice), the teacher can write more. Each block starts with
``prompt_tokens`` tokens of the run's train split (valid without one), taken at evenly spaced places, and
the run's base model continues it by ancestral sampling (``temperature``, ``top_p``; top-k off; EOS held
back until the block is full) to ``data.seq_len`` tokens. Trained on with the distillation loss this is
sequence-level knowledge distillation (Kim & Rush, 2016); LLM-QAT (Liu et al., 2023) distils a quantised
model on text its full-precision model generates.

The blocks are written once per run into ``finetune_data/KEY/blocks.npy`` (as a streamed source's are,
read back by :func:`~sinv_prune.pipeline.data_stream.load_blocks`), so every arm trains on the same text;
``KEY`` covers the settings, the prompts' source, the model's weights (a fingerprint) and the seed.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from sinv_prune.strict_json import dumps

logger = logging.getLogger("sinv_prune")


def prompt_starts(n_ids: int, prompt_tokens: int, count: int) -> list[int]:
    """``count`` start positions of ``prompt_tokens``-token prompts spread evenly over ``n_ids`` tokens."""
    room = n_ids - prompt_tokens
    if room < 0:
        raise ValueError(f"finetune.data.generate: the prompts' text has {n_ids} tokens, fewer than prompt_tokens")
    return [int(i * room / (count - 1)) for i in range(count)] if count > 1 else [0]


def generated_key(spec, model, ids: torch.Tensor, seq_len: int, count: int, seed: int) -> str:
    """What the written blocks depend on (the directory's name)."""
    from sinv_prune.pipeline.distill_cache import teacher_fingerprint

    source = hashlib.sha256(np.ascontiguousarray(ids.cpu().numpy().astype(np.int32)).tobytes()).hexdigest()
    key = {"generate": spec.model_dump(mode="json"), "model": teacher_fingerprint(model), "prompts_from": source,
           "seq_len": seq_len, "count": count, "seed": seed}  # fmt: skip
    return hashlib.sha256(dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def sample_continuations(model, prompts: torch.Tensor, seq_len: int, spec, *, eos_token_id=None) -> torch.Tensor:
    """``prompts`` (``[n, p]`` ids) continued by ``model`` to ``seq_len`` tokens by sampling (``[n, seq_len]``).

    Draws from the global torch generator: seed it (and fork it) around the call for a reproducible text.
    """
    from transformers import GenerationConfig

    new = seq_len - prompts.shape[1]
    config = GenerationConfig(do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=0,
                              max_new_tokens=new, min_new_tokens=new, eos_token_id=eos_token_id,
                              pad_token_id=eos_token_id if eos_token_id is not None else 0)  # fmt: skip
    device = model.get_input_embeddings().weight.device
    prompts = prompts.to(device)
    with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
    return out[:, :seq_len]


def generated_blocks(
    model,
    ids: torch.Tensor,
    spec,
    seq_len: int,
    count: int,
    directory: Path,
    *,
    seed: int = 0,
    eos_token_id: int | None = None,
    progress: bool = False,
) -> Path:
    """``count`` blocks of ``seq_len`` tokens ``model`` writes from prompts out of ``ids``, as
    ``directory/KEY/blocks.npy`` (written once; a block directory with the same key is reused)."""
    from sinv_prune.progress import bar
    from sinv_prune.rundir import write_dir

    if spec.prompt_tokens >= seq_len:
        raise ValueError(f"finetune.data.generate.prompt_tokens ({spec.prompt_tokens}) must be below seq_len "
                         f"({seq_len})")  # fmt: skip
    target = Path(directory) / generated_key(spec, model, ids, seq_len, count, seed)
    if (target / "meta.json").is_file():
        logger.info("finetune.data.generate: reusing %s", target)
        return target / "blocks.npy"
    starts = prompt_starts(len(ids), spec.prompt_tokens, count)
    was_training = model.training
    model.eval()
    device = model.get_input_embeddings().weight.device

    def write(d: Path) -> None:
        out = np.lib.format.open_memmap(d / "blocks.npy", mode="w+", dtype=np.int32, shape=(count, seq_len))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for first in bar(range(0, count, spec.batch_size), desc="teacher text", unit="batch", disable=not progress):
                chunk = starts[first : first + spec.batch_size]
                prompts = torch.stack([ids[s : s + spec.prompt_tokens] for s in chunk]).long()
                out[first : first + len(chunk)] = (
                    sample_continuations(model, prompts, seq_len, spec, eos_token_id=eos_token_id).cpu().numpy()
                )
        out.flush()
        del out
        (d / "meta.json").write_text(dumps({"blocks": count, "seq_len": seq_len, "wanted": count,
                                            "generate": spec.model_dump(mode="json"), "seed": seed}))  # fmt: skip

    try:
        write_dir(target, write)
    finally:
        model.train(was_training)
    logger.info("finetune.data.generate: %d blocks of %d tokens written by the base model -> %s", count, seq_len,
                target)  # fmt: skip
    return target / "blocks.npy"
