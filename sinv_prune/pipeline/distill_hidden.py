"""Intermediate-state distillation (``distill.hidden_weight``): the student's block outputs learn the teacher's.

Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge Distillation") adds to
the logit KL a loss on the hidden states between blocks. Here, for each pair ``(s, t)`` of a student block and
the teacher block it descends from, with ``h`` the block's output (the residual stream after it)::

    L_hidden = mean over pairs of  sum_tokens ||h_s - h_t||^2 / sum_tokens ||h_t||^2

over the tokens that carry a label (a relative squared error, so blocks with large activations do not
dominate), added to the distillation loss as ``hidden_weight * L_hidden``. Pairs come from the pruning
records (``config.sinv_prune``): student block ``i`` is original block ``kept_layers()[i]``, and so is the
teacher's (an unpruned teacher's block ``j`` is original block ``j``); ``distill.hidden_layers`` picks original
blocks, omitted: every block both keep. Widths must match (pruning never changes the hidden size here).

The outputs are taken by forward hooks on the blocks (:class:`BlockOutputs`), so the model's forward is
unchanged; the student's keep their autograd graph, the teacher's run under ``no_grad``.

``distill.hidden_inputs: teacher`` makes it a layer-wise loss on the kept blocks: ``h_s`` is then student
block ``s`` run once more on the *teacher's* input to block ``t`` (its other arguments, the mask and the
position embeddings, from the student's own call), so every block learns to redo its teacher block's step
from the same starting point, whatever the blocks before it do (:func:`forced_outputs`). It costs one more
forward and backward of every paired block per step.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.record import get_record


def original_layers(model: nn.Module) -> list[int]:
    """Original block index of each current block (``kept_layers()`` of its record; ``0..L-1`` unpruned)."""
    record = get_record(model.config)
    if record is not None:
        return record.kept_layers()
    return list(range(get_adapter(model).num_layers))


def layer_pairs(student: nn.Module, teacher: nn.Module, layers: list[int] | None = None) -> list[tuple[int, int]]:
    """``[(student block, teacher block), ...]`` that descend from the same original block (``layers``: only these).

    A ``ValueError`` when an asked-for block is gone from either model, or when no pair is left.
    """
    s_orig, t_orig = original_layers(student), original_layers(teacher)
    t_index = {o: i for i, o in enumerate(t_orig)}
    common = [o for o in s_orig if o in t_index]
    if layers is not None:
        missing = sorted(set(layers) - set(common))
        if missing:
            raise ValueError(f"distill.hidden_layers: original block(s) {missing} are not in both student and teacher")
        common = [o for o in common if o in set(layers)]
    if not common:
        raise ValueError("distill.hidden_weight: the student and the teacher share no block")
    s_index = {o: i for i, o in enumerate(s_orig)}
    return [(s_index[o], t_index[o]) for o in common]


class BlockOutputs:
    """Within the block, ``outputs[i]`` is what block ``i`` of ``model`` (one of ``layers``) gave last forward;
    with ``calls``, ``calls[i]`` is the ``(args, kwargs)`` it was called with."""

    def __init__(self, model: nn.Module, layers: list[int], calls: bool = False):
        self.blocks = get_adapter(model).layers()
        self.layers = layers
        self.keep_calls = calls
        self.outputs: dict[int, torch.Tensor] = {}
        self.calls: dict[int, tuple[tuple, dict]] = {}
        self._handles: list = []

    def _hook(self, index: int):
        def keep(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output

        return keep

    def _pre_hook(self, index: int):
        def keep(module, args, kwargs):
            self.calls[index] = (args, kwargs)

        return keep

    def __enter__(self) -> BlockOutputs:
        self._handles = [self.blocks[i].register_forward_hook(self._hook(i)) for i in self.layers]
        if self.keep_calls:
            self._handles += [self.blocks[i].register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
                              for i in self.layers]  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> dict[int, torch.Tensor]:
        """The outputs kept since the last ``take`` (and forget them and the calls)."""
        out, self.outputs, self.calls = self.outputs, {}, {}
        return out


def _block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def forced_outputs(student: BlockOutputs, teacher: BlockOutputs, pairs) -> dict[int, torch.Tensor]:
    """``{s: student block s run on teacher block t's input}`` for each pair (the hooks' last forward of both).

    The student's other arguments (attention mask, position embeddings, ...) are those of its own call;
    call it after the hooks are removed, so that this forward is not recorded again.
    """
    out = {}
    for s, t in pairs:
        args, kwargs = student.calls[s]
        h = _block_input(*teacher.calls[t]).detach().to(_block_input(args, kwargs).device)
        if args:
            args = (h, *args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": h}
        # the forward's KV cache already holds this block's keys: this extra call must not add to it
        kwargs = {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}
        y = student.blocks[s](*args, **kwargs)
        out[s] = y[0] if isinstance(y, tuple) else y
    return out


def hidden_loss(
    student: dict[int, torch.Tensor], teacher: dict[int, torch.Tensor], pairs, keep: torch.Tensor
) -> torch.Tensor:
    """``L_hidden`` of the module docstring (float32) over the positions where ``keep`` ([batch, seq]) is true."""
    terms = []
    for s, t in pairs:
        hs, ht = student[s][keep].float(), teacher[t][keep].to(student[s].device).float()
        if hs.shape != ht.shape:
            raise ValueError(f"distill.hidden_weight: student block {s} gives {tuple(hs.shape)}, "
                             f"teacher block {t} {tuple(ht.shape)} (the widths must match)")  # fmt: skip
        terms.append((hs - ht).pow(2).sum() / ht.pow(2).sum().clamp(min=1e-12))
    return torch.stack(terms).mean()
