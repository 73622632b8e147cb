"""llama.cpp architectures, one module each; importing the package registers them all."""

from sinv_prune.deploy.archs import deci, gpt2, llama, olmoe, qwen2, qwen2moe, qwen3, qwen3moe  # noqa: F401
from sinv_prune.deploy.archs.base import GGUFArch, LayerShape
from sinv_prune.deploy.archs.registry import candidates, families, get_arch, native_arch, register

__all__ = ["GGUFArch", "LayerShape", "candidates", "families", "get_arch", "native_arch", "register"]
