"""Routing statistics of a mixture-of-experts model: how often each expert is chosen, per MoE layer.

A forward hook on every router (``adapter.router(layer)``, whose forward returns ``(router_logits,
top_k_weights, top_k_index)``) counts the top-k indices over the evaluation text: non-overlapping
windows of ``data.seq_len`` tokens, at most ``data.max_eval_tokens`` of them. Counts are reported in
the original numbering (layers and experts of the unpruned model, from the pruning record
``config.sinv_prune``), so a pruned model's row lines up with the baseline's: a removed expert is 0.

Per original MoE layer (keys are strings, as JSON has them)::

    {"tokens": 20480, "top_k": 2, "num_experts": 16,
     "layers": {"0": {"counts": [...], "share": [...], "removed": [3, 9], "effective_experts": 11.7}}}

``share`` is each expert's part of the layer's selections (sums to 1; ``1 / num_experts`` each when
balanced) and ``effective_experts`` is ``exp(entropy(share))``, from 1 (one expert takes every
token) to ``num_experts`` (perfect balance).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.record import get_record


def is_moe(model: nn.Module) -> bool:
    """Whether the model has routed experts in some layer."""
    return bool(get_adapter(model).expert_counts())


def routing_statistics(
    model: nn.Module, ids: torch.Tensor, *, seq_len: int, batch_size: int = 8, max_tokens: int | None = None
) -> dict | None:
    """Expert selection counts per MoE layer over ``ids`` (a 1-D token stream); None for a dense model."""
    adapter = get_adapter(model)
    moe = [i for i in range(adapter.num_layers) if adapter.num_experts(i)]
    if not moe:
        return None
    record = get_record(model.config)
    origin = record.kept_layers() if record is not None else list(range(adapter.num_layers))
    original = record is not None and record.num_experts is not None
    num_experts = record.num_experts if original else max(adapter.num_experts(i) for i in moe)
    kept = {i: (record.kept_experts(origin[i]) if original else list(range(adapter.num_experts(i)))) for i in moe}
    counts = {i: torch.zeros(len(kept[i]), dtype=torch.long) for i in moe}

    def hook(layer: int):
        def count(module, args, output) -> None:
            index = output[2]
            counts[layer] += torch.bincount(index.reshape(-1).cpu(), minlength=len(kept[layer]))

        return count

    ids = ids.reshape(-1)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    length = min(seq_len, ids.numel())
    windows = ids[: ids.numel() // length * length].view(-1, length)
    handles = [adapter.router(i).register_forward_hook(hook(i)) for i in moe]
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for chunk in torch.split(windows, batch_size):
                model(input_ids=chunk.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    layers = {}
    for i in moe:
        full = [0] * num_experts
        for current, expert in enumerate(kept[i]):
            full[expert] = int(counts[i][current])
        total = sum(full)
        share = [c / total if total else 0.0 for c in full]
        entropy = -sum(p * math.log(p) for p in share if p > 0)
        gone = sorted(set(range(num_experts)) - set(kept[i]))
        layers[str(origin[i])] = {
            "counts": full,
            "share": share,
            "removed": gone,
            "effective_experts": math.exp(entropy) if total else None,
        }
    return {"tokens": int(windows.numel()), "top_k": adapter.top_k(), "num_experts": num_experts, "layers": layers}
