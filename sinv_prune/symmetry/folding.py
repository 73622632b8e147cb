"""Checkpoints of symmetry-broken models carry ``E[b_Q]``, ``E[b_V]`` inside the projection biases.

In evaluation a symmetry-broken layer computes ``q = W_Q x + b + E[b_Q]`` (and the same for
``v``): exactly what a plain layer whose query bias is ``b + E[b_Q]`` computes. So every
``state_dict()`` of such a model (what ``save_pretrained``, ``push_to_hub`` and Trainer
checkpoints write) holds the folded biases, and a checkpoint gives the same evaluation outputs
through every reload route: the stock class, ``trust_remote_code=True`` and
:func:`sinv_prune.from_pretrained`. The last one also unfolds them again (and re-adds the hooks),
so training can go on with the random biases; ``load_state_dict`` into a model that has symmetry
breaking unfolds too, so a state dict round-trips exactly.

Where the bias sits:

* GPT-2: the query and value columns of the fused ``c_attn`` bias;
* BERT family: the ``query`` and ``value`` biases;
* LLaMA family: ``q_proj`` / ``v_proj`` biases, present in Qwen2; LLaMA and Qwen3 get them by
  ``config.attention_bias = True`` (which also gives ``k_proj`` and ``o_proj`` biases, saved as
  zeros). ``b_Q`` is added before the rotary embedding, exactly where a ``q_proj`` bias sits.

Where no bias can hold a mean (Mistral has no attention biases; Qwen3 adds ``b_Q`` after its
per-head ``q_norm``), :func:`fold_plan` refuses, so a model that could not be saved faithfully is
never trained with symmetry breaking in the first place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

_LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class FoldTarget:
    """``E[b_<kind>]`` is folded into the bias of ``attn.<child>``, block ``block`` of ``blocks``."""

    kind: str
    child: str
    block: int = 0
    blocks: int = 1


@dataclass(frozen=True)
class FoldPlan:
    """Where one attention module's means go, and whether ``config.attention_bias`` must be turned on."""

    targets: tuple[FoldTarget, ...]
    needs_attention_bias: bool = False


def fold_plan(attn: nn.Module, config, kinds: tuple[str, ...]) -> FoldPlan:
    """Where ``attn`` keeps ``E[b]`` in a checkpoint; ``ValueError`` where no bias can hold it."""
    arch = getattr(config, "model_type", type(attn).__name__)
    if hasattr(attn, "c_attn") and not getattr(attn, "is_cross_attention", False):
        return FoldPlan(tuple(FoldTarget(k, "c_attn", 0 if k == "q" else 2, 3) for k in kinds))
    if hasattr(attn, "query") and hasattr(attn, "value"):
        children = {"q": "query", "v": "value"}
    elif hasattr(attn, "q_proj") and hasattr(attn, "v_proj"):
        q_norm = getattr(attn, "q_norm", None)
        if "q" in kinds and isinstance(q_norm, nn.Module) and not isinstance(q_norm, nn.Identity):
            raise ValueError(
                f"{arch}: b_Q is added after the per-head q_norm, where no bias exists to carry E[b_Q] into a "
                "checkpoint that stock transformers reloads; use b_q=None (b_V only)"
            )
        children = {"q": "q_proj", "v": "v_proj"}
    else:
        raise ValueError(f"symmetry breaking does not know the q/v projections of {arch!r} ({type(attn).__name__})")
    targets = tuple(FoldTarget(k, children[k]) for k in kinds)
    missing = [t.child for t in targets if getattr(attn, t.child).bias is None]
    if missing and not hasattr(config, "attention_bias"):
        raise ValueError(
            f"{arch}: {', '.join(missing)} have no bias and {type(config).__name__} has no attention_bias, so "
            "E[b_Q]/E[b_V] could not be saved in a checkpoint that stock transformers reloads"
        )
    return FoldPlan(targets, needs_attention_bias=bool(missing))


def _bias_shape(module: nn.Module) -> tuple[int, torch.dtype, torch.device]:
    weight = module.weight
    width = weight.shape[1] if isinstance(module, Conv1D) else weight.shape[0]
    return width, weight.dtype, weight.device


def _fold_vector(mean: torch.Tensor, target: FoldTarget, width: int, device: torch.device) -> torch.Tensor:
    """``mean`` (``d_head``) repeated over every head of ``target``'s block of a ``width`` bias, zeros elsewhere."""
    block = width // target.blocks
    out = torch.zeros(width, dtype=torch.float32, device=device)
    out[target.block * block : (target.block + 1) * block] = mean.float().to(device).repeat(block // mean.numel())
    return out


def _shifted(bias: torch.Tensor, mean: torch.Tensor, target: FoldTarget, sign: int) -> torch.Tensor:
    """A new tensor ``bias + sign * E[b]`` laid over the heads, in ``bias``'s dtype."""
    return (bias.float() + sign * _fold_vector(mean, target, bias.numel(), bias.device)).to(bias.dtype)


def _added_children(attn: nn.Module, plan: FoldPlan) -> list[str]:
    """Projections that exist in a checkpoint only because ``attention_bias`` was turned on."""
    if not plan.needs_attention_bias:
        return []
    return [c for c in _LLAMA_PROJECTIONS if hasattr(attn, c) and getattr(attn, c).bias is None]


class FoldOnSave:
    """``state_dict`` post-hook of one attention module: write ``bias + E[b]`` (new tensors, never in place)."""

    def __init__(self, attn: nn.Module, plan: FoldPlan):
        self.attn, self.plan = attn, plan

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for child in _added_children(self.attn, self.plan):
            width, dtype, device = _bias_shape(getattr(self.attn, child))
            state_dict[f"{prefix}{child}.bias"] = torch.zeros(width, dtype=dtype, device=device)
        for target in self.plan.targets:
            key = f"{prefix}{target.child}.bias"
            state_dict[key] = _shifted(state_dict[key], _mean(self.attn, target), target, +1)


class UnfoldOnLoad:
    """``load_state_dict`` pre-hook: subtract ``E[b]`` again; drop biases the live model does not have."""

    def __init__(self, attn: nn.Module, plan: FoldPlan):
        self.attn, self.plan = attn, plan

    def __call__(self, module, state_dict, prefix, *args) -> None:
        for target in self.plan.targets:
            key = f"{prefix}{target.child}.bias"
            if key in state_dict:
                state_dict[key] = _shifted(state_dict[key], _mean(self.attn, target), target, -1)
        for child in _added_children(self.attn, self.plan):
            key = f"{prefix}{child}.bias"
            if key in state_dict and not torch.count_nonzero(state_dict[key]):
                del state_dict[key]


def _mean(attn: nn.Module, target: FoldTarget) -> torch.Tensor:
    return getattr(attn, f"sinv_b_{target.kind}_mean")


@torch.no_grad()
def unfold_parameters(attn: nn.Module, targets: tuple[FoldTarget, ...], means: dict[str, torch.Tensor]) -> None:
    """Subtract ``means`` (per kind, ``d_head``) from a freshly loaded module's biases, in place."""
    for target in targets:
        bias = getattr(attn, target.child).bias
        bias.copy_(_shifted(bias, means[target.kind], target, -1))


@torch.no_grad()
def drop_zero_attention_biases(attn: nn.Module, dry_run: bool = False) -> bool:
    """Remove the q/k/v/o biases if all are zero (``dry_run``: only say whether they are); True if so."""
    children = [c for c in _LLAMA_PROJECTIONS if hasattr(attn, c) and getattr(attn, c).bias is not None]
    if not children or any(torch.count_nonzero(getattr(attn, c).bias) for c in children):
        return False
    if dry_run:
        return True
    for child in children:
        getattr(attn, child).register_parameter("bias", None)
    return True
