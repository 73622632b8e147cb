"""``sinv-prune eval SOURCE --tasks ...``: lm-eval tasks (and WikiText-2 perplexity) for any checkpoint.

SOURCE is what the other commands take: a checkpoint directory (pruned or not; remote-code
pruned models load through :func:`sinv_prune.from_pretrained`, no ``trust_remote_code``), a
Hub id, or a GGUF file. The tasks are checked (and ``wikitext_lastword`` built into
:func:`sinv_prune.lmeval.lastword.cache_root`) before the model is loaded.
"""

from __future__ import annotations

import os
from typing import Any

from sinv_prune.lmeval.harness import evaluate_tasks, resolve_tasks
from sinv_prune.lmeval.lastword import cache_root, source_file
from sinv_prune.pipeline.device_choice import default_device
from sinv_prune.surgery.keep_tokenizer import has_tokenizer

#: ``--perplexity``: windows of at most this many tokens (fewer where the model's context is shorter), half overlapping.
PERPLEXITY_SEQ_LEN = 512


def evaluate_source(
    source: str,
    tasks: list[str],
    *,
    gguf_file: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = 0,
    batch_size: int | str = "auto",
    device: str | None = None,
    perplexity: bool = False,
    max_tokens: int | None = None,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """Load SOURCE, run ``tasks`` (and WikiText-2 test perplexity); ``{"source", "tasks", "lm_eval", ...}``.

    ``tokenizer``: where to load the tokenizer from (default: SOURCE itself). A checkpoint directory
    without one is refused (``ValueError``, one line saying how to fix it) before anything loads.
    The ``"lm_eval"`` key holds the pins; ``"raw"`` lm-eval's own result dict (for its table).
    """

    from sinv_prune.data import load_model_tokenizer
    from sinv_prune.surgery.checkpoint import from_pretrained

    if tokenizer is None and not gguf_file and os.path.isdir(source) and not has_tokenizer(source):
        raise ValueError(
            f"{source} has no tokenizer: pass --tokenizer PATH (the directory, Hub id or .gguf file it came from), "
            "or save it next to the model (tokenizer.save_pretrained)"
        )
    task_set = resolve_tasks(tasks, os.getcwd(), build_dir=cache_root(), where="--tasks") if tasks else None
    text = source_file().read_text(encoding="utf-8") if perplexity else None
    device = default_device(device)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = from_pretrained(source, **kwargs).to(device).eval()
    tokenizer = load_model_tokenizer(tokenizer) if tokenizer else load_model_tokenizer(source, **kwargs)
    out: dict[str, Any] = {"source": source, **({"gguf_file": gguf_file} if gguf_file else {})}
    if task_set is not None:
        result = evaluate_tasks(model, tokenizer, task_set, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size)
        out.update(tasks=result["tasks"], lm_eval=result["pins"], raw=result["lm_eval"])
    if text is not None:
        out["perplexity"] = wikitext_perplexity(model, tokenizer, text, max_tokens=max_tokens)
    return out


def wikitext_perplexity(model, tokenizer, text: str, *, max_tokens: int | None = None) -> dict[str, Any]:
    """Strided-window perplexity of the WikiText-2 test text (docs/evaluation.md), as a recipe measures it."""
    from sinv_prune.data import token_ids
    from sinv_prune.pipeline.evaluation import perplexity
    from sinv_prune.pipeline.generations import context_length

    ids = token_ids(text.splitlines(), tokenizer)
    seq_len = min(PERPLEXITY_SEQ_LEN, context_length(model.config) or PERPLEXITY_SEQ_LEN)
    res = perplexity(model, ids, seq_len=seq_len, stride=seq_len // 2, batch_size=4, max_tokens=max_tokens)
    return {**res, "source": str(source_file())}
