"""What one llama.cpp architecture means to the exporter: what it loads, what it cannot express, its keys.

An architecture class answers three questions (read from llama.cpp's loaders, ``src/models/*.cpp``
and ``src/llama-model.cpp`` as vendored in llama-cpp-python 0.3.36): which model settings it cannot
reproduce at all (:meth:`GGUFArch.check_config`, cheap: before any weight is copied), whether it
can express a model's per-layer shapes and biases (:meth:`GGUFArch.refusal`), and which keys it
reads (:meth:`GGUFArch.add_hparams`). The LLaMA-family architectures share one base.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np


@dataclass(frozen=True)
class LayerShape:
    """One layer as llama.cpp sees it."""

    heads: int
    kv_heads: int
    ffn: int
    #: Routed experts (0: a dense layer), one expert's width, the shared expert's width (Qwen2-MoE; else 0).
    experts: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0


class GGUFArch:
    """One llama.cpp architecture. Subclasses set the attributes and override what differs."""

    #: llama.cpp's name for the architecture (``general.architecture``).
    name: str = ""
    #: gguf-py's id, for tensor names.
    model_arch: gguf.MODEL_ARCH
    #: transformers ``model_type`` values this is llama.cpp's own architecture for.
    families: tuple[str, ...] = ()
    #: Per-layer projection biases it loads where present (GGUF tensor kinds).
    optional_biases: frozenset[str] = frozenset()
    #: Whether q and k rows are permuted from transformers' half-split RoPE to llama.cpp's pairs.
    permute_rope: bool = False
    #: Whether it reads per-layer head counts and MLP widths (else one set for every layer).
    per_layer: bool = False
    #: Whether it runs a LLaMA-family model it is not native to (tried after the native one).
    fallback: bool = False
    #: Whether it can take models of the LLaMA family (llama, mistral, qwen2, qwen3).
    llama_family: bool = False
    #: Whether attention must span the hidden size (heads x head_dim = hidden): a fused QKV, or a loader
    #: that sizes the attention output from the hidden size.
    full_width_attention: bool = False
    #: The config's name for the hidden size (as the refusal names it).
    hidden_key: str = "hidden_size"
    #: Whether it reads routed experts (``ffn_gate_inp`` and ``ffn_*_exps``; see :mod:`.moe`).
    experts: bool = False
    #: Whether its loader needs ``output.weight`` even when the model ties it to the embeddings.
    output_required: bool = False
    #: Float32 round trip rule: (median, worst) position's logit difference, relative (gguf_verify).
    f32_tolerance: tuple[float, float] = (1.5e-5, 2e-4)

    def check_config(self, config) -> None:
        """Raise ``ExportRefused`` for a setting no shape of the model could make exportable here."""

    def refusal(self, config, layers: list[LayerShape], head_dim: int, biases: dict[int, set[str]]) -> str | None:
        """Why this architecture cannot run the model exactly, or None. ``biases``: non-zero bias kinds per layer."""
        for i, kinds in biases.items():
            extra = sorted(kinds - self.optional_biases)
            if extra:
                return f"llama.cpp's {self.name} has no {extra[0]} bias (layer {i})"
        moe = [i for i, s in enumerate(layers) if s.experts]
        if moe and not self.experts:
            return f"llama.cpp's {self.name} has no mixture-of-experts layers"
        if len({s.experts for s in layers if s.experts}) > 1:
            counts = sorted({s.experts for s in layers if s.experts})
            return (
                f"llama.cpp reads one expert count per model, and the MoE layers keep {counts[0]} to {counts[-1]} "
                "experts (prune the same number in every layer: mode 'uniform')"
            )
        if not self.per_layer and len(set(layers)) > 1:
            what = next(
                (
                    word
                    for word, key in (
                        ("head counts", lambda s: (s.heads, s.kv_heads)),
                        ("MLP widths", lambda s: s.ffn),
                        ("expert widths", lambda s: s.expert_ffn),
                        ("shared-expert widths", lambda s: s.shared_ffn),
                    )
                    if len({key(s) for s in layers}) > 1
                ),
                "expert counts",
            )
            return (
                f"llama.cpp's {self.name} reads one set of sizes for every layer, and the layers keep different {what}"
            )
        hidden = getattr(config, self.hidden_key)
        if self.full_width_attention and layers[0].heads * head_dim != hidden:
            return (
                f"llama.cpp's {self.name} needs heads x head_dim = {self.hidden_key} "
                f"({layers[0].heads} x {head_dim} != {hidden})"
            )
        return None

    def add_hparams(self, writer: gguf.GGUFWriter, config, layout, n_vocab: int) -> None:
        """The architecture keys llama.cpp reads."""
        raise NotImplementedError

    def tensor_data(self, key: str, data):
        """A state-dict tensor as llama.cpp stores it (``[out, in]``), or None to leave it out."""
        return data

    def split_tensor(self, key: str, data) -> list[tuple]:
        """A state-dict entry as the ``(key, data)`` pairs the tensor name map knows (fused weights split)."""
        return [(key, data)]

    def extra_tensors(self, config, head_dim: int) -> list[tuple[str, np.ndarray]]:
        """Tensors llama.cpp reads that the model has no weight for (name, float32 data)."""
        return []

    @staticmethod
    def per_layer_value(layout, attr: str):
        values = [getattr(s, attr) for s in layout.layers]
        return values if not layout.uniform else values[0]
