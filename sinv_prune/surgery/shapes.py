"""Dropping whole blocks, which :func:`~sinv_prune.prune` does after the per-layer cuts (those are the
units' own, ``sinv_prune/units/<unit>/cuts.py``, on a live model and, through ``rebuild``, on a reload)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from sinv_prune.arch import HeadAdapter


def drop_layers(model: nn.Module, adapter: HeadAdapter, drop: Iterable[int]) -> None:
    """Remove the blocks ``drop`` (current numbering) and renumber everything that indexes layers.

    The kept blocks' ``layer_idx`` attributes (the KV cache slot of each attention) become their
    new positions; ``config.num_hidden_layers`` (GPT-2 ``n_layer``), ``config.layer_types``,
    Qwen2's ``max_window_layers`` and Qwen2/3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``
    describe the new stack, so ``DynamicCache(config=...)``, the per-layer attention masks and a
    class built from the config (a reload) line up. The ModuleList and config lists are replaced,
    not mutated.
    """
    gone = set(drop)
    stack = adapter.layer_stack()
    old = len(stack)
    kept = [block for i, block in enumerate(stack) if i not in gone]
    stack._modules = dict((str(j), block) for j, block in enumerate(kept))
    for j, block in enumerate(kept):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = j
    config = model.config
    window = getattr(config, "max_window_layers", None)
    if isinstance(window, int) and window < old:  # layers below it are full attention: count the kept ones
        config.max_window_layers = sum(1 for i in range(min(window, old)) if i not in gone)
    types = getattr(config, "layer_types", None)
    if types is not None:
        config.layer_types = [t for i, t in enumerate(types) if i not in gone]
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "mlp_only_layers", None), list):
        _renumber_sparse_layers(config, adapter, gone, old)


def _renumber_sparse_layers(config, adapter: HeadAdapter, gone: set[int], old: int) -> None:
    """Qwen2/3-MoE: layer ``i`` is dense when ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``;
    renumber the list, and where the step no longer lands on the kept MoE layers, state every dense layer
    in the list with step 1, so each kept block is rebuilt as the kind it is."""
    new = {i: i - sum(1 for g in gone if g < i) for i in range(old) if i not in gone}
    listed = [new[i] for i in config.mlp_only_layers if i in new]
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = [j for j in range(len(new)) if not adapter.num_experts(j)]
    if [j for j in range(len(new)) if j in listed or (j + 1) % step] != dense:
        listed, config.decoder_sparse_step = dense, 1
    config.mlp_only_layers = listed
