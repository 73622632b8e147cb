"""Greedy continuations of fixed prompts: people judge a pruned model by reading what it writes.

Each prompt is encoded on its own (the tokenizer's special tokens included, as for any
generation), and ``model.generate`` continues it greedily (``do_sample=False``, one beam) for
:data:`NEW_TOKENS` tokens or until EOS, whatever the model's own generation config says; fewer
when the model's context (``n_positions`` / ``max_position_embeddings``) ends first. Only the new
tokens are decoded. Deterministic: the same model and prompts give the same text.
"""

from __future__ import annotations

import torch

#: What a recipe's ``evaluate.prompts`` defaults to.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Once upon a time, there was a",
    "The most important thing to know about the weather is",
)
NEW_TOKENS = 32


def context_length(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def greedy_continuations(model, tokenizer, prompts, max_new_tokens: int = NEW_TOKENS) -> list[dict]:
    """``[{"prompt", "continuation", "new_tokens"}]``: each prompt continued greedily by ``model``."""
    from transformers import GenerationConfig

    device = model.get_input_embeddings().weight.device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    limit = context_length(model.config)
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.inference_mode():
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
                room = max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - ids.shape[1]))
                new: list[int] = []
                if room:
                    config = GenerationConfig(
                        max_new_tokens=room, do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad
                    )
                    mask = torch.ones_like(ids)
                    generated = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                    new = generated[0, ids.shape[1] :].tolist()
                text = tokenizer.decode(new, skip_special_tokens=True)
                out.append({"prompt": prompt, "continuation": text, "new_tokens": len(new)})
    finally:
        model.train(was_training)
    return out
