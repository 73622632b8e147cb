"""Which llama.cpp architecture can run a (pruned) model exactly, and why the others cannot.

A model's per-layer shape (query heads, KV heads, MLP width) is read through its adapter. The
candidates (:func:`sinv_prune.deploy.archs.candidates`), tried in order, are the family's own
llama.cpp architecture (``llama`` for LLaMA, Mistral and Mixtral, ``qwen2``, ``qwen3``, ``gpt2``,
``qwen2moe``, ``qwen3moe``, ``olmoe``), then
``llama`` (any head count, optional biases, for a uniform Qwen2 whose query width is no longer the
hidden size), then ``deci`` (per-layer arrays, attention skipped where a layer has 0 heads); a
mixture-of-experts model has no fallback (no other architecture reads its experts). Each
architecture's rules live in its own module under :mod:`sinv_prune.deploy.archs`. The first
candidate that expresses the model exactly wins; when none does, the refusal names what llama.cpp
lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.deploy.archs import GGUFArch, LayerShape, candidates, families, native_arch
from sinv_prune.deploy.archs.llama_family import rope_parameters
from sinv_prune.deploy.archs.moe import MOE_FAMILIES
from sinv_prune.deploy.errors import ExportRefused

__all__ = ["GGUFLayout", "LayerShape", "check_exportable", "plan_layout", "rope_parameters"]


@dataclass
class GGUFLayout:
    """The architecture chosen for a model and the per-layer shapes it is written with."""

    writer: GGUFArch
    family: str
    layers: list[LayerShape]
    head_dim: int
    notes: list[str] = field(default_factory=list)

    @property
    def arch(self) -> str:
        """llama.cpp's name for the chosen architecture."""
        return self.writer.name

    @property
    def uniform(self) -> bool:
        return len(set(self.layers)) == 1

    @property
    def permute_qk(self) -> bool:
        return self.writer.permute_rope


def check_exportable(model: nn.Module, verify: bool | None = None) -> GGUFArch:
    """The cheap refusals, before any weight is copied (also a recipe's preflight, before pruning):
    the family, its language-model head, settings its llama.cpp architecture cannot reproduce, and for a
    mixture-of-experts model the per-layer shapes (expert counts, dense layers, heads) read from its modules."""
    family = model.config.model_type
    native = native_arch(family)
    if native is None:
        raise ExportRefused(_unsupported(family))
    if getattr(model, "lm_head", None) is None:
        raise ExportRefused(f"{type(model).__name__} has no language-model head; export the ...ForCausalLM model")
    native.check_config(model.config)
    if family in MOE_FAMILIES:  # the shape refusals too (expert counts, dense layers), before any expert is copied
        _choose(model.config, native, *layer_shapes(model), {})
    if verify:
        from sinv_prune.deploy.gguf_verify import PIP_HINT, llama_cpp_available

        if not llama_cpp_available():
            raise ExportRefused(f"verify: true needs llama-cpp-python: {PIP_HINT}")
    return native


def plan_layout(model: nn.Module, biases: dict[int, set[str]]) -> GGUFLayout:
    """The llama.cpp architecture that runs ``model`` exactly, or ``ExportRefused`` naming what llama.cpp lacks.

    ``biases`` maps each layer to the GGUF tensor kinds that carry a (non-zero) bias there.
    """
    native = check_exportable(model)
    return _choose(model.config, native, *layer_shapes(model), biases)


def layer_shapes(model: nn.Module) -> tuple[list[LayerShape], int]:
    """Each layer's shape as llama.cpp sees it (heads, KV heads, MLP width, experts), and the head size."""
    adapter = get_adapter(model)
    layers = []
    for i in range(adapter.num_layers):
        attn = adapter.layout(i)
        experts = adapter.num_experts(i) if hasattr(adapter, "num_experts") else 0
        expert_ffn = adapter.expert_width(i) if experts else 0
        shared = getattr(adapter.moe_block(i), "shared_expert", None) if experts else None
        shared_ffn = shared.down_proj.weight.shape[1] if shared is not None else 0
        layers.append(LayerShape(attn.num_heads, attn.num_kv_heads, adapter.intermediate_size(i), experts,
                                 expert_ffn, shared_ffn))  # fmt: skip
    return layers, adapter.layout(0).head_dim


def _choose(config, native: GGUFArch, layers: list[LayerShape], head_dim: int, biases) -> GGUFLayout:
    reasons = []
    for arch in candidates(config.model_type):
        reason = arch.refusal(config, layers, head_dim, biases)
        if reason is None:
            layout = GGUFLayout(arch, config.model_type, layers, head_dim)
            if arch is not native:
                layout.notes.append(f"written as llama.cpp '{arch.name}' ({reasons[-1]} under '{native.name}')")
            return layout
        reasons.append(reason)
    raise ExportRefused(f"cannot export this {config.model_type} model to GGUF exactly: {reasons[-1]}")


def _unsupported(family: str) -> str:
    if family in ("bert", "roberta"):
        return (
            f"cannot export {family} to GGUF: llama.cpp runs {family} only as an embedding model "
            "(no masked-LM head) with one head count for every layer"
        )
    if family == "gpt_oss":
        return (
            "cannot export gpt_oss to GGUF: llama.cpp has a gpt-oss architecture, but the exporter does not write "
            "its attention sinks, interleaved gate/up experts with biases, clamped SwiGLU and router bias"
        )
    return f"cannot export {family} to GGUF: the exporter knows {', '.join(families())}"
