"""The recipe's model settings (``dtype``, ``device_map``, ``attn_implementation``) and LoRA fine-tuning.

Every model a run loads (the starting model, each arm's saved checkpoint, the distillation
teacher) goes through :func:`load_kwargs`, so the whole run keeps one dtype and one placement.
``finetune.lora`` wraps the pruned model with ``peft`` for training and merges the adapters
back (:func:`merge_lora`) before the model is saved: the checkpoint stays a plain pruned model.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from sinv_prune.pipeline.recipe import DEVICE_MAP_STRATEGIES, LoraSpec, Recipe, RecipeError, first_line


def torch_dtype(recipe: Recipe) -> torch.dtype | None:
    """The recipe's ``model.dtype`` as a torch dtype; None for ``auto`` (the checkpoint's own)."""
    name = recipe.model.dtype
    return None if name == "auto" else getattr(torch, name)


def load_kwargs(recipe: Recipe) -> dict[str, Any]:
    """Keyword arguments for ``from_pretrained`` that carry the recipe's model settings."""
    spec = recipe.model
    kwargs: dict[str, Any] = {}
    if torch_dtype(recipe) is not None:
        kwargs["dtype"] = torch_dtype(recipe)
    if spec.device_map is not None:
        kwargs["device_map"] = spec.device_map
    if spec.attn_implementation is not None:
        kwargs["attn_implementation"] = spec.attn_implementation
    return kwargs


def is_placed(model: nn.Module) -> bool:
    """Whether ``model`` was loaded with a ``device_map`` (then it is never moved as a whole)."""
    return getattr(model, "hf_device_map", None) is not None


def to_device(model: nn.Module, device: str) -> nn.Module:
    """``model`` on ``device``, unless a ``device_map`` placed it."""
    return model if is_placed(model) else model.to(device)


def input_device(recipe: Recipe) -> str | None:
    """Where inputs go for a recipe's ``device_map`` (its first non-CPU device), or None to use the default."""
    devices = _map_devices(recipe.model.device_map)
    if not devices:
        return None
    accelerators = [d for d in devices if d.type != "cpu"]
    return str(accelerators[0] if accelerators else devices[0])


def unloadable_reason(model: nn.Module) -> str | None:
    """Why a model loaded with a ``device_map`` cannot be pruned (offloaded weights), or None."""
    from sinv_prune.arch import get_adapter
    from sinv_prune.surgery.offload import is_offloaded
    from sinv_prune.surgery.removal import unprunable_reason

    reason = unprunable_reason(model, get_adapter(model))
    if reason is None and is_offloaded(model):  # the criteria and the fine-tune read weights in place
        reason = "it offloads weights (cpu next to a GPU, or disk), which scoring and fine-tuning cannot read"
    return None if reason is None else f"model.device_map: cannot prune this placement: {reason}"


def check_model_settings(recipe: Recipe, model: nn.Module) -> None:
    """``RecipeError`` for model settings that cannot work; ``model``: the starting model on the meta device."""
    spec = recipe.model
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec.device_map is not None and world > 1:
        raise RecipeError(
            f"model.device_map: one model split over devices cannot run in a multi-process launch "
            f"(WORLD_SIZE={world}, torchrun / accelerate launch); drop device_map or run one process"
        )
    for device in _map_devices(spec.device_map):
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise RecipeError(f"model.device_map: {device} is not here ({torch.cuda.device_count()} CUDA devices)")
    if spec.attn_implementation is not None:
        check_attn_implementation(model, spec.attn_implementation)
    lora = recipe.finetune.lora if recipe.finetune is not None else None
    if lora is not None and lora.target_modules is not None:
        names = [name for name, _ in model.named_modules()]
        for i, target in enumerate(lora.target_modules):
            if not any(name == target or name.endswith("." + target) for name in names):
                raise RecipeError(f"finetune.lora.target_modules[{i}]: the model has no module {target!r}")


def check_attn_implementation(model: nn.Module, name: str) -> None:
    """``RecipeError`` when ``model``'s class cannot use attention ``name`` (unknown, or its package missing).

    Through public APIs only: the model is built again on the meta device from a copy of its config
    with ``attn_implementation=name`` (``PreTrainedConfig.from_dict``), and the model's constructor
    checks the implementation as it does for ``from_pretrained(..., attn_implementation=name)``.
    """
    config = type(model.config).from_dict(model.config.to_dict(), attn_implementation=name)
    try:
        with torch.device("meta"):
            type(model)(config)
    except (ImportError, ValueError) as err:
        raise RecipeError(f"model.attn_implementation: {first_line(err)}") from None


def _map_devices(device_map) -> list[torch.device]:
    if device_map is None or device_map in DEVICE_MAP_STRATEGIES:
        return []
    devices = [device_map] if isinstance(device_map, str) else list(device_map.values())
    return [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]


def default_target_modules(model: nn.Module) -> list[str]:
    """The full names of every attention and MLP linear projection that still has weights."""
    from sinv_prune.arch import get_adapter

    adapter = get_adapter(model)
    wanted: set[int] = set()
    for layer in range(adapter.num_layers):
        roots = [adapter.attention(layer), adapter.out_proj(layer), *adapter.mlp_in(layer), adapter.mlp_out(layer)]
        for root in roots:
            for module in root.modules():
                if isinstance(module, (nn.Linear, Conv1D)) and module.weight.numel() > 0:
                    wanted.add(id(module))
    return [name for name, module in model.named_modules() if id(module) in wanted]


def wrap_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """``model`` with trainable LoRA adapters (``peft``) on ``spec.target_modules``; the rest frozen.

    Works with gradient checkpointing because transformers checkpoints non-reentrantly by default
    (frozen embeddings then still give the checkpointed blocks a gradient path).
    """
    from peft import LoraConfig, get_peft_model

    targets = spec.target_modules or default_target_modules(model)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets)
    with warnings.catch_warnings():
        # peft reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning in 5.x) to decide
        # whether to make the input embeddings require grads; checkpointing is enabled later, by the Trainer,
        # and is non-reentrant, so the answer (False) is right and the warning is noise for our users.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain model with its LoRA adapters folded into the weights (what gets saved)."""
    return model.merge_and_unload().requires_grad_(True)
