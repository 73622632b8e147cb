"""``export_gguf``: a (pruned) transformers model as one GGUF file that llama.cpp runs exactly.

What runs, in order: the weights are read from ``model.state_dict()`` and named for llama.cpp
(:mod:`~sinv_prune.deploy.gguf_tensors`) after the cheap refusals (family, settings); the
architecture is chosen from the per-layer shapes and biases, or the export is refused with one
line naming what llama.cpp lacks (:mod:`~sinv_prune.deploy.gguf_layout`, each architecture's rules
in :mod:`sinv_prune.deploy.archs`); metadata, tokenizer
(:mod:`~sinv_prune.deploy.gguf_vocab`) and tensors are written to a temporary file next to
``path``, which is renamed into place only when complete; then, by default when llama-cpp-python
is installed, the file is loaded in llama.cpp and its logits compared with the model's
(:mod:`~sinv_prune.deploy.gguf_verify`) before the file is moved into place: a failed check,
like a refusal, leaves nothing at the output path. Memory: one float32 copy of the weights (plus the
quantized copy being written).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import torch
from torch import nn

from sinv_prune.deploy import gguf_verify
from sinv_prune.deploy.errors import ExportRefused, RoundTripFailed
from sinv_prune.deploy.gguf_layout import check_exportable, plan_layout
from sinv_prune.deploy.gguf_quantize import K_QUANTS, quantize, require_quantizer
from sinv_prune.deploy.gguf_tensors import (
    FILE_TYPES,
    QTYPES,
    Tensor,
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
#: Every ``type=`` the export writes: its own encodings, then llama.cpp's K-quants.
TYPES = (*QTYPES, *K_QUANTS)
NO_TOKENIZER = (
    "no tokenizer for the GGUF file: pass the model's tokenizer (the CLI's --tokenizer PATH), a GGUF file to "
    "copy it from (tokenizer_gguf=), or vocab=False (--no-vocab) for a vocabulary-free file"
)


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
    vocab: bool = True,
) -> GGUFExport:
    """Write ``model`` (pruned or not) as a GGUF file llama.cpp runs, any per-layer shape it can express.

    ``type``: ``f32``, ``f16``, ``bf16``, ``q8_0`` or ``q4_0`` (1-D tensors stay float32), or a
    K-quant made by llama.cpp's quantiser from a float32 file written first: ``q4_k_m``, ``q5_k_m``,
    ``q6_k`` (needs llama-cpp-python).
    ``tokenizer``: a transformers tokenizer; its keys are copied from ``tokenizer_gguf`` instead
    (default: the GGUF file the model was loaded from, if any). With neither, the export is refused
    unless ``vocab=False`` asks for a vocabulary-free file (token ids in, logits out), which chat
    front ends (ollama, llama.cpp's chat) cannot use.
    ``verify``: load the file in llama.cpp and compare logits with the model before it is moved into
    place (default: when llama-cpp-python is installed); a float32 file that does not match raises
    :class:`~sinv_prune.deploy.errors.RoundTripFailed` and leaves nothing at ``path``.
    Raises :class:`~sinv_prune.deploy.errors.ExportRefused` (one line, nothing written) when no
    llama.cpp architecture computes what the model computes or an argument is wrong.

    Example::

        model = sinv_prune.from_pretrained("runs/x/arms/taylor/finetuned")
        print(sinv_prune.export_gguf(model, tokenizer, "model.gguf", type="q8_0"))
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise ExportRefused(f"{path} exists; pass overwrite=True to replace it")
    tokenizer, source, verify = _checked_arguments(model, tokenizer, type, verify, tokenizer_gguf, vocab)
    native = check_exportable(model)  # the cheap refusals, before the float32 copy of the weights
    tensors = collect_tensors(model, native)
    layout = plan_layout(model, nonzero_biases(tensors))
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
    float_file = f"{tmp}.f32" if type in K_QUANTS else tmp
    try:
        writer = gguf.GGUFWriter(float_file, layout.arch)
        stored = "f32" if type in K_QUANTS else type
        _add_general(writer, model, name, stored, parameters)
        layout.writer.add_hparams(writer, model.config, layout, n_vocab)
        vocab_note = add_vocab(writer, tokenizer, n_vocab, source)
        extra = [Tensor(n, d, None) for n, d in layout.writer.extra_tensors(model.config, layout.head_dim)]
        for t in tensors + extra:
            data, qtype = encode(t, QTYPES[stored])
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=current_mode() == "bars")  # no redraws in a log
        writer.close()
        if type in K_QUANTS:
            quantize(float_file, tmp, type)
            Path(float_file).unlink()
        result = GGUFExport(path, layout.arch, type, Path(tmp).stat().st_size, parameters, len(layout.layers),
                            vocab_note, list(layout.notes))  # fmt: skip
        if verify:
            result.verify = _round_trip(tmp, model, tokenizer, type, n_vocab, layout.arch)
            if not result.verify.passed:
                raise RoundTripFailed(
                    f"{path}: llama.cpp's logits do not match transformers' ({result.verify.failure()}); "
                    "nothing was written"
                )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        Path(float_file).unlink(missing_ok=True)
        raise
    return result


def _checked_arguments(model, tokenizer, type: str, verify, tokenizer_gguf, vocab: bool):  # noqa: A002
    """``(tokenizer, source GGUF, verify)`` as the export uses them, or :class:`ExportRefused`."""
    if type not in TYPES:
        raise ExportRefused(f"type must be one of {', '.join(TYPES)}, got {type!r}")
    require_quantizer(type)
    if verify is None:
        verify = gguf_verify.llama_cpp_available()
    elif verify and not gguf_verify.llama_cpp_available():
        raise ExportRefused(f"verify=True needs llama-cpp-python: {gguf_verify.PIP_HINT}")
    source = tokenizer_gguf if tokenizer_gguf is not None else getattr(model, SOURCE_ATTR, None)
    if source is not None and not Path(source).is_file():
        raise ExportRefused(f"tokenizer_gguf: {source} is not a file")
    if not vocab:
        return None, None, verify
    if tokenizer is None and source is None:
        raise ExportRefused(NO_TOKENIZER)
    return tokenizer, source, verify


def check_gguf_export(
    model: nn.Module,
    tokenizer,
    *,
    type: str = "f16",  # noqa: A002
    verify: bool | None = None,
    tokenizer_gguf: str | os.PathLike | None = None,
    vocab: bool = True,
) -> None:
    """Raise the :class:`ExportRefused` that :func:`export_gguf` would raise for these arguments before writing
    any tensor (type, quantiser, llama.cpp architecture, vocabulary), writing nothing: so a command that
    prunes first (``sinv-prune shrink --gguf``) can refuse before its work rather than after it."""
    tokenizer, source, _ = _checked_arguments(model, tokenizer, type, verify, tokenizer_gguf, vocab)
    native = check_exportable(model)
    n_vocab = model.get_input_embeddings().weight.shape[0]
    add_vocab(gguf.GGUFWriter(None, native.name), tokenizer, n_vocab, source)  # in memory: no file is opened


def _round_trip(file: str, model: nn.Module, tokenizer, type: str, n_vocab: int, arch: str):  # noqa: A002
    """The built-in check: a short prompt in both, judged when the file stores the model's own float32 weights."""
    ids = gguf_verify.prompt_ids(tokenizer, n_vocab)
    exact = type == "f32" and next(model.parameters()).dtype == torch.float32
    return gguf_verify.verify_gguf(file, model, ids, exact_type=exact, arch=arch, continue_tokens=CONTINUE_TOKENS,
                                   tokenizer=tokenizer)  # fmt: skip


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
