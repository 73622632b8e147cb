"""``export_gguf``: a (pruned) transformers model as one GGUF file that llama.cpp runs exactly.

What runs, in order: the weights are read from ``model.state_dict()`` and named for llama.cpp
(:mod:`~sinv_prune.deploy.gguf_tensors`); the architecture is chosen from the per-layer shapes
and biases, or the export is refused with one line naming what llama.cpp lacks
(:mod:`~sinv_prune.deploy.gguf_layout`); metadata, tokenizer
(:mod:`~sinv_prune.deploy.gguf_vocab`) and tensors are written to a temporary file next to
``path``, which is renamed into place only when complete; then, by default when llama-cpp-python
is installed, the file is loaded in llama.cpp and its logits compared with the model's
(:mod:`~sinv_prune.deploy.gguf_verify`). A failed check leaves the file and says so in the
summary; nothing is written on a refusal. Memory: one float32 copy of the weights (plus the
quantized copy being written).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from sinv_prune.deploy import gguf_verify
from sinv_prune.deploy.gguf_layout import GGUFLayout, plan_layout, rope_parameters
from sinv_prune.deploy.gguf_tensors import (
    FILE_TYPES,
    QTYPES,
    collect_tensors,
    drop_zero_biases,
    encode,
    nonzero_biases,
    permute_qk,
)
from sinv_prune.deploy.gguf_vocab import add_vocab
from sinv_prune.progress import current_mode
from sinv_prune.surgery.record import get_record
from sinv_prune.version import __version__

#: Attribute ``sinv_prune.from_pretrained`` sets on a model loaded from a GGUF file (its path).
SOURCE_ATTR = "sinv_gguf_source"
#: Greedy tokens generated on both sides by the check, shown side by side in the summary and report.
CONTINUE_TOKENS = 16


@dataclass
class GGUFExport:
    """What ``export_gguf`` wrote: file, llama.cpp architecture, storage type, size, check result."""

    path: Path
    arch: str
    type: str
    size_bytes: int
    parameters: int
    layers: int
    tokenizer: str
    notes: list[str] = field(default_factory=list)
    verify: gguf_verify.VerifyResult | None = None

    def __str__(self) -> str:
        lines = [
            f"wrote {self.path} ({self.size_bytes / 2**20:.1f} MiB, {self.type}, llama.cpp '{self.arch}', "
            f"{self.layers} layers, {self.parameters:,} parameters)",
            f"tokenizer: {self.tokenizer}",
            *self.notes,
        ]
        if self.verify is not None:
            lines.append(str(self.verify))
        return "\n".join(lines)

    def to_json(self) -> dict:
        data = {k: v for k, v in vars(self).items() if k != "verify"}
        data["path"] = str(self.path)
        data["verify"] = vars(self.verify) if self.verify else None
        return data


def export_gguf(
    model: nn.Module,
    tokenizer,
    path: str | os.PathLike,
    *,
    type: str = "f16",  # noqa: A002 - the name llama.cpp's tools use
    verify: bool | None = None,
    tokenizer_gguf: str | os.PathLike | None = None,
    name: str | None = None,
    overwrite: bool = False,
) -> GGUFExport:
    """Write ``model`` (pruned or not) as a GGUF file llama.cpp runs, any per-layer shape it can express.

    ``type``: ``f32``, ``f16``, ``bf16``, ``q8_0`` or ``q4_0`` (1-D tensors stay float32).
    ``tokenizer``: a transformers tokenizer, or None for a vocabulary-free file. The tokenizer keys
    are copied from ``tokenizer_gguf`` (default: the GGUF file the model was loaded from, if any).
    ``verify``: load the file in llama.cpp and compare logits with the model (default: when
    llama-cpp-python is installed). Raises ``ValueError`` (one line, nothing written) when no
    llama.cpp architecture computes what the model computes.

    Example::

        model = sinv_prune.from_pretrained("runs/x/arms/taylor/finetuned")
        print(sinv_prune.export_gguf(model, tokenizer, "model.gguf", type="q8_0"))
    """
    if type not in QTYPES:
        raise ValueError(f"type must be one of {', '.join(QTYPES)}, got {type!r}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists; pass overwrite=True to replace it")
    if verify is None:
        verify = gguf_verify.llama_cpp_available()
    elif verify and not gguf_verify.llama_cpp_available():
        raise ValueError(f"verify=True needs llama-cpp-python: {gguf_verify.PIP_HINT}")
    source = tokenizer_gguf if tokenizer_gguf is not None else getattr(model, SOURCE_ATTR, None)
    if source is not None and not Path(source).is_file():
        raise ValueError(f"tokenizer_gguf: {source} is not a file")

    family_arch = {"mistral": "llama"}.get(model.config.model_type, model.config.model_type)
    tensors = collect_tensors(model, family_arch) if family_arch in ("llama", "qwen2", "qwen3", "gpt2") else None
    layout = plan_layout(model, nonzero_biases(tensors or []))
    if layout.arch != "gpt2":  # gpt2's loader needs every bias; the others take them where present
        tensors = drop_zero_biases(tensors)
    if layout.arch == "deci":  # deci loads no attention norm where a layer has no heads (its output is unused)
        empty = {i for i, shape in enumerate(layout.layers) if shape.heads == 0}
        tensors = [t for t in tensors if not (t.layer in empty and t.kind == "attn_norm")]
    if layout.permute_qk:
        permute_qk(tensors, [s.heads for s in layout.layers], [s.kv_heads for s in layout.layers])
    n_vocab = model.get_input_embeddings().weight.shape[0]
    parameters = sum(p.numel() for p in model.parameters())

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, layout.arch)
        _add_general(writer, model, name, type, parameters)
        _add_hparams(writer, model.config, layout, n_vocab)
        vocab_note = add_vocab(writer, tokenizer, n_vocab, source)
        for t in tensors + _extra_tensors(model.config, layout):
            data, qtype = encode(t, QTYPES[type])
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=current_mode() == "bars")  # no redraws in a log
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    result = GGUFExport(path, layout.arch, type, path.stat().st_size, parameters, len(layout.layers), vocab_note,
                        list(layout.notes))  # fmt: skip
    if verify:
        ids = gguf_verify.prompt_ids(tokenizer, n_vocab)
        exact = type == "f32" and next(model.parameters()).dtype == torch.float32
        result.verify = gguf_verify.verify_gguf(
            path, model, ids, exact_type=exact, continue_tokens=CONTINUE_TOKENS, tokenizer=tokenizer
        )
    return result


def _add_general(writer: gguf.GGUFWriter, model: nn.Module, name: str | None, type: str, parameters: int) -> None:
    config = model.config
    writer.add_type(gguf.GGUFType.MODEL)
    label = name or getattr(config, "_model_name_or_path", None) or Path(config.name_or_path or "model").name
    record = get_record(config)
    writer.add_name(f"{label} (pruned)" if record and not name else str(label))
    writer.add_size_label(gguf.size_label(parameters, 0, 0, 0))
    writer.add_file_type(FILE_TYPES[type])
    if type in ("q8_0", "q4_0"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string("sinv_prune.version", __version__)
    writer.add_uint64("sinv_prune.parameter_count", parameters)
    if record is not None:
        writer.add_string("sinv_prune.record", json.dumps(record.to_json(), sort_keys=True, allow_nan=False))


def _add_hparams(writer: gguf.GGUFWriter, config, layout: GGUFLayout, n_vocab: int) -> None:
    """The architecture keys llama.cpp reads; per-layer arrays under ``deci``."""
    per_layer = not layout.uniform

    def value(attr: str):
        values = [getattr(s, attr) for s in layout.layers]
        return values if per_layer else values[0]

    writer.add_block_count(len(layout.layers))
    writer.add_vocab_size(n_vocab)
    writer.add_feed_forward_length(value("ffn"))
    writer.add_head_count(value("heads"))
    if layout.family == "gpt2":
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    writer.add_head_count_kv(value("kv_heads"))
    context = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if layout.family == "mistral" and window and window < context:
        context = window  # llama.cpp's llama has no sliding window: within it, both compute the same
        layout.notes.append(f"context length {window}: Mistral's sliding window, which llama.cpp's llama lacks")
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(layout.head_dim)
    writer.add_value_length(layout.head_dim)
    writer.add_rope_dimension_count(layout.head_dim)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _extra_tensors(config, layout: GGUFLayout) -> list:
    """``rope_freqs`` for Llama-3 RoPE scaling, computed as llama.cpp's converter does."""
    from sinv_prune.deploy.gguf_tensors import Tensor

    rope = rope_parameters(config) if layout.family != "gpt2" else {}
    if rope.get("rope_type") != "llama3":
        return []
    dim, base = layout.head_dim, rope["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return [Tensor("rope_freqs.weight", np.array(factors, dtype=np.float32), None)]
