"""What llama.cpp's mixture-of-experts architectures share: expert tensors, expert keys, routing.

transformers stores a layer's experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows
first; ``mlp.experts.down_proj`` ``[E, H, I]``) behind a router ``mlp.gate`` (``[E, H]``); llama.cpp
reads ``ffn_gate_exps`` / ``ffn_up_exps`` (``[E, I, H]`` as numpy holds them, ggml's ``{H, I, E}``),
``ffn_down_exps`` and the router ``ffn_gate_inp``, and one ``expert_count`` / ``expert_used_count``
for the whole model (read from llama.cpp's loaders, ``src/models/{llama,qwen2moe,qwen3moe,olmoe}.cpp``,
as vendored in llama-cpp-python 0.3.36). What llama.cpp does with the top-k routing weights is fixed
per architecture in its graph code (``build_moe_ffn``'s ``norm_w``), not read from the file:
``llama`` (Mixtral) and ``qwen3moe`` renormalise them, ``qwen2moe`` and ``olmoe`` do not, so a model
whose ``norm_topk_prob`` says otherwise is refused.
"""

from __future__ import annotations

from typing import ClassVar

import gguf

from sinv_prune.deploy.archs.base import LayerShape
from sinv_prune.deploy.errors import ExportRefused

#: transformers ``model_type`` values with routed experts the exporter writes.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_GATE_UP = ".experts.gate_up_proj"
_DOWN = ".experts.down_proj"
_SHARED_GATE = ".shared_expert_gate.weight"


def renormalises(config) -> bool:
    """Whether transformers renormalises a layer's top-k routing weights (Mixtral always does)."""
    if config.model_type == "mixtral":
        return True
    return bool(getattr(config, "norm_topk_prob", False))


class ExpertsMixin:
    """Routed experts for a LLaMA-family architecture class (put it before the base class)."""

    experts = True
    #: What llama.cpp's graph does with the top-k weights (hard-coded there): renormalise them or not.
    renormalises: ClassVar[bool] = True
    #: Whether it runs Qwen2-MoE's shared expert behind its sigmoid gate.
    shared_expert: ClassVar[bool] = False
    #: Whether it reads ``expert_feed_forward_length`` (else the expert width is ``feed_forward_length``).
    expert_width_key: ClassVar[bool] = False

    def check_config(self, config) -> None:
        super().check_config(config)
        if config.model_type not in MOE_FAMILIES:
            return
        if renormalises(config) != self.renormalises:
            does = "always renormalises" if self.renormalises else "never renormalises"
            raise ExportRefused(
                f"cannot export: llama.cpp's {self.name} {does} the top-k expert weights "
                f"(norm_topk_prob={getattr(config, 'norm_topk_prob', None)} here)"
            )

    def refusal(self, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
        moe = [i for i, s in enumerate(layers) if s.experts]
        if moe and len(moe) < len(layers):
            dense = [i for i, s in enumerate(layers) if not s.experts]
            return (
                f"llama.cpp's {self.name} reads a router in every layer, and layers {dense} are dense "
                "(mlp_only_layers / decoder_sparse_step)"
            )
        if not moe and config.model_type in MOE_FAMILIES:
            return f"llama.cpp's {self.name} needs experts, and no layer of this {config.model_type} model has any"
        if moe and self.shared_expert and not all(s.shared_ffn for s in layers):
            return f"llama.cpp's {self.name} needs a shared expert in every layer"
        if moe and not self.shared_expert and any(s.shared_ffn for s in layers):
            return f"llama.cpp's {self.name} has no shared expert"
        return super().refusal(config, layers, head_dim, biases)

    def ffn_length(self, layout) -> int | list[int]:
        first = layout.layers[0]
        return first.expert_ffn if first.experts else super().ffn_length(layout)

    def add_hparams(self, writer: gguf.GGUFWriter, config, layout, n_vocab: int) -> None:
        super().add_hparams(writer, config, layout, n_vocab)
        first = layout.layers[0]
        if not first.experts:
            return
        writer.add_expert_count(first.experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if self.expert_width_key:
            writer.add_expert_feed_forward_length(first.expert_ffn)
        if self.shared_expert:
            writer.add_expert_shared_feed_forward_length(first.shared_ffn)

    def split_tensor(self, key: str, data) -> list[tuple]:
        """Fused experts split into llama.cpp's gate and up tensors; the shared-expert gate as a vector."""
        if key.endswith(_GATE_UP):
            stem = key[: -len("gate_up_proj")]
            gate, up = data.chunk(2, dim=1)
            return [(f"{stem}gate_proj.weight", gate), (f"{stem}up_proj.weight", up)]
        if key.endswith(_DOWN):
            return [(f"{key}.weight", data)]
        if key.endswith(_SHARED_GATE):
            return [(key, data.reshape(-1))]  # Linear(H, 1): llama.cpp reads {n_embd}
        return [(key, data)]
