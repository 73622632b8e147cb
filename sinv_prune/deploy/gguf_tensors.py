"""A model's weights as llama.cpp tensors: GGUF names, orientation, RoPE row order, storage type.

The weights come from ``model.state_dict()`` (which folds symmetry-breaking biases into the
projection biases, as ``save_pretrained`` writes them). Names go through ``gguf.TensorNameMap``
after the architecture splits fused weights (a MoE layer's ``experts.gate_up_proj`` into llama.cpp's
gate and up experts, :mod:`sinv_prune.deploy.archs.moe`); GPT-2's ``Conv1D`` weights are transposed
to ``[out, in]``; under ``llama`` / ``deci`` the q and
k rows (and biases) of each layer are permuted with that layer's head counts, as llama.cpp's
``convert_hf_to_gguf.py`` does for LLaMA (transformers rotates halves, llama.cpp pairs). Empty
tensors (a layer with no heads) and all-zero biases are left out: llama.cpp's loaders treat the
biases as optional and skip attention where a layer has no heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from sinv_prune.deploy.archs import GGUFArch
from sinv_prune.deploy.errors import ExportRefused

#: Storage type per ``type=`` choice; 1-D tensors (norms, biases) stay float32 in every file.
QTYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}


@dataclass
class Tensor:
    """One tensor to write: GGUF name, float32 data in ``[out, in]`` order, its layer (or None)."""

    name: str
    data: np.ndarray
    layer: int | None

    @property
    def kind(self) -> str:
        """``attn_q``, ``ffn_down``, ... (the name without ``blk.N.`` and the suffix)."""
        parts = self.name.split(".")
        return parts[2] if parts[0] == "blk" else parts[0]


def collect_tensors(model: nn.Module, arch: GGUFArch) -> list[Tensor]:
    """Every non-empty weight of ``model`` under its GGUF name (as llama.cpp's ``arch`` names it), float32."""
    config = model.config
    n_layers = config.num_hidden_layers if hasattr(config, "num_hidden_layers") else config.n_layer
    name_map = gguf.get_tensor_name_map(arch.model_arch, n_layers)
    state = model.state_dict()
    tied = _tied(model)
    out = []
    for key, value in state.items():
        if (tied and key == "lm_head.weight" and not arch.output_required) or value.numel() == 0:
            continue
        data = arch.tensor_data(key, value.detach().to("cpu", torch.float32))
        if data is None:
            continue
        for part, piece in arch.split_tensor(key, data):
            name = name_map.get_name(part, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ExportRefused(f"cannot export: tensor {key!r} has no place in llama.cpp's {arch.name}")
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            out.append(Tensor(name, piece.contiguous().numpy(), layer))
    return out


def _tied(model: nn.Module) -> bool:
    head, embed = getattr(model, "lm_head", None), model.get_input_embeddings()
    return head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


#: Tensor kinds whose bias is optional in llama.cpp's LLaMA-family loaders (norm biases exist only in GPT-2).
PROJECTIONS = {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def nonzero_biases(tensors: list[Tensor]) -> dict[int, set[str]]:
    """Per layer, the projections that carry a non-zero bias."""
    out: dict[int, set[str]] = {}
    for t in tensors:
        if t.layer is not None and t.name.endswith(".bias") and t.kind in PROJECTIONS and t.data.any():
            out.setdefault(t.layer, set()).add(t.kind)
    return out


def drop_zero_biases(tensors: list[Tensor]) -> list[Tensor]:
    """Leave out all-zero projection biases (optional in the LLaMA-family loaders; writing them costs bytes)."""
    return [t for t in tensors if not (t.name.endswith(".bias") and t.kind in PROJECTIONS and not t.data.any())]


def permute_rope(data: np.ndarray, heads: int) -> np.ndarray:
    """Rows of ``heads`` rotary heads from transformers' half-split order to llama.cpp's interleaved order.

    The same reshaping as ``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py``.
    """
    shape = data.shape
    return data.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def permute_qk(tensors: list[Tensor], heads: list[int], kv_heads: list[int]) -> None:
    """Permute each layer's q and k rows in place, with that layer's own head counts."""
    for t in tensors:
        if t.kind == "attn_q":
            t.data = permute_rope(t.data, heads[t.layer])
        elif t.kind == "attn_k":
            t.data = permute_rope(t.data, kv_heads[t.layer])


#: Tensor kinds stored float32 in every file, as llama.cpp's converter keeps them: the expert routers
#: (a rounded router logit can pick another expert).
FLOAT32_KINDS = {"ffn_gate_inp", "ffn_gate_inp_shexp"}


def encode(t: Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Data and storage type for one tensor: 1-D ones and routers float32; a row length the block size
    does not divide falls back to float16 (as convert_hf_to_gguf does)."""
    if t.data.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32 or t.kind in FLOAT32_KINDS:
        return t.data.astype(np.float32), gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if t.data.shape[-1] % block:
        qtype = gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(t.data, qtype), qtype
