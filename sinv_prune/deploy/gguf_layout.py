"""Which llama.cpp architecture can run a (pruned) model exactly, and why the others cannot.

A model's per-layer shape (query heads, KV heads, MLP width) is read through its adapter. The
candidates, tried in order, are the family's own llama.cpp architecture (``llama`` for LLaMA and
Mistral, ``qwen2``, ``qwen3``, ``gpt2``), then ``llama`` (any head count, optional biases, for a
uniform Qwen2 whose query width is no longer the hidden size), then ``deci`` (llama.cpp's
Nemotron-NAS architecture: per-layer ``head_count``, ``head_count_kv`` and
``feed_forward_length`` arrays, attention skipped where a layer has 0 heads). What each one reads
was taken from llama.cpp's loaders (``src/models/{llama,qwen2,qwen3,gpt2,deci}.cpp`` and
``src/llama-model.cpp``, as vendored in llama-cpp-python 0.3.36). The first candidate that
expresses the model exactly wins; when none does, the refusal names what llama.cpp lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.deploy.errors import ExportRefused

#: Families this exporter writes, and the llama.cpp architecture each has of its own.
NATIVE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
#: Optional per-layer biases each llama.cpp architecture loads (GGUF tensor kinds; gpt2 needs all).
OPTIONAL_BIASES = {
    "llama": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"},
    "deci": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"},
    "qwen2": {"attn_q", "attn_k", "attn_v"},
    "qwen3": {"attn_q", "attn_k", "attn_v"},
    "gpt2": {"attn_qkv", "attn_output", "ffn_up", "ffn_down"},
}
#: Architectures whose rotary embedding pairs neighbouring dimensions (llama.cpp ROPE_TYPE_NORM):
#: q and k rows are permuted on the way in, as llama.cpp's convert_hf_to_gguf does for LLaMA.
PERMUTED_ROPE = {"llama", "deci"}


@dataclass(frozen=True)
class LayerShape:
    """One layer as llama.cpp sees it."""

    heads: int
    kv_heads: int
    ffn: int


@dataclass
class GGUFLayout:
    """The architecture chosen for a model and the per-layer shapes it is written with."""

    arch: str
    family: str
    layers: list[LayerShape]
    head_dim: int
    notes: list[str] = field(default_factory=list)

    @property
    def uniform(self) -> bool:
        return len(set(self.layers)) == 1

    @property
    def permute_qk(self) -> bool:
        return self.arch in PERMUTED_ROPE


def plan_layout(model: nn.Module, biases: dict[int, set[str]]) -> GGUFLayout:
    """The llama.cpp architecture that runs ``model`` exactly, or ``ValueError`` naming what llama.cpp lacks.

    ``biases`` maps each layer to the GGUF tensor kinds that carry a (non-zero) bias there.
    """
    config = model.config
    family = config.model_type
    if family not in NATIVE:
        raise ExportRefused(_unsupported(family))
    if getattr(model, "lm_head", None) is None:
        raise ExportRefused(f"{type(model).__name__} has no language-model head; export the ...ForCausalLM model")
    adapter = get_adapter(model)
    layers = [
        LayerShape(adapter.layout(i).num_heads, adapter.layout(i).num_kv_heads, adapter.intermediate_size(i))
        for i in range(adapter.num_layers)
    ]
    head_dim = adapter.layout(0).head_dim
    _check_config(config, family)
    candidates = [NATIVE[family]] + ([] if family == "gpt2" else [a for a in ("llama", "deci") if a != NATIVE[family]])
    reasons = []
    for arch in candidates:
        reason = _refusal(arch, config, layers, head_dim, biases)
        if reason is None:
            layout = GGUFLayout(arch, family, layers, head_dim)
            if arch != NATIVE[family]:
                layout.notes.append(f"written as llama.cpp '{arch}' ({reasons[-1]} under '{NATIVE[family]}')")
            return layout
        reasons.append(reason)
    raise ExportRefused(f"cannot export this {family} model to GGUF exactly: {reasons[-1]}")


def check_exportable(model: nn.Module, verify: bool | None = None) -> None:
    """What can be refused before any pruning (a recipe's preflight): the family and its settings."""
    family = model.config.model_type
    if family not in NATIVE:
        raise ExportRefused(_unsupported(family))
    _check_config(model.config, family)
    if verify:
        from sinv_prune.deploy.gguf_verify import PIP_HINT, llama_cpp_available

        if not llama_cpp_available():
            raise ExportRefused(f"verify: true needs llama-cpp-python: {PIP_HINT}")


def _unsupported(family: str) -> str:
    if family in ("bert", "roberta"):
        return (
            f"cannot export {family} to GGUF: llama.cpp runs {family} only as an embedding model "
            "(no masked-LM head) with one head count for every layer"
        )
    return f"cannot export {family} to GGUF: the exporter knows LLaMA-family (llama, mistral, qwen2, qwen3) and GPT-2"


def _check_config(config, family: str) -> None:
    """Model settings no llama.cpp architecture here reproduces."""
    if family == "gpt2":
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise ExportRefused(
                "cannot export: llama.cpp's gpt2 has no per-layer attention scaling (scale_attn_by_inverse_layer_idx)"
            )
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ExportRefused(f"cannot export: llama.cpp's gpt2 uses tanh-GELU, not {config.activation_function!r}")
        return
    if config.hidden_act != "silu":
        raise ExportRefused(f"cannot export: llama.cpp's {family} MLP uses SiLU, not {config.hidden_act!r}")
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ExportRefused("cannot export: llama.cpp's llama/deci rotate the whole head (partial_rotary_factor < 1)")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        raise ExportRefused(f"cannot export: llama.cpp's {NATIVE[family]} has no sliding-window layers")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        raise ExportRefused(
            f"cannot export: rope_type {rope['rope_type']!r} is not written (default, linear, llama3 are)"
        )


def rope_parameters(config) -> dict:
    """The config's RoPE settings (transformers 5 ``rope_parameters``, older ``rope_theta``/``rope_scaling``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in rope:
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        rope.setdefault("rope_type" if key == "type" else key, value)
    return rope


def _refusal(arch: str, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
    """Why llama.cpp's ``arch`` cannot run this model exactly, or None."""
    uniform = len(set(layers)) == 1
    for i, kinds in biases.items():
        extra = sorted(kinds - OPTIONAL_BIASES[arch])
        if extra:
            return f"llama.cpp's {arch} has no {extra[0]} bias (layer {i})"
    if arch != "deci" and not uniform:
        what = "head counts" if len({(s.heads, s.kv_heads) for s in layers}) > 1 else "MLP widths"
        return f"llama.cpp's {arch} reads one set of sizes for every layer, and the layers keep different {what}"
    if arch == "gpt2":
        if layers[0].heads * head_dim != config.n_embd:
            return (
                f"llama.cpp's gpt2 needs heads x head_dim = n_embd in its fused QKV "
                f"({layers[0].heads} x {head_dim} != {config.n_embd})"
            )
        return None
    if config.model_type == "qwen3" and arch != "qwen3":
        return f"llama.cpp's {arch} has no per-head q/k norm (Qwen3's q_norm / k_norm)"
    if arch == "qwen2" and layers[0].heads * head_dim != config.hidden_size:
        return (
            f"llama.cpp's qwen2 needs heads x head_dim = hidden size "
            f"({layers[0].heads} x {head_dim} != {config.hidden_size})"
        )
    if arch != "deci" and layers[0].heads == 0:
        return f"llama.cpp's {arch} cannot skip attention (every layer lost all its heads)"
    if arch == "deci":
        if layers[0].heads == 0:
            return "llama.cpp's deci reads the head size from layer 0, which has no attention heads"
        for i, shape in enumerate(layers):
            if shape.heads == 0 and "attn_output" in biases.get(i, set()):
                return f"llama.cpp's deci skips an attention-free layer entirely, dropping its output bias (layer {i})"
    return None
