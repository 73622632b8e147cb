"""K-quants (``q4_k_m``, ``q5_k_m``, ``q6_k``) through llama.cpp's own quantiser.

The export writes a float32 file first, then ``llama_model_quantize`` (llama-cpp-python) turns it
into the K-quant mix llama.cpp's ``llama-quantize`` makes: the same per-tensor choices (``_M``: some
attention-value and FFN-down tensors a step up), the same fallback to legacy types for rows that
256 does not divide. Writing these types ourselves would mean re-implementing that mix; llama.cpp
keeps it.
"""

from __future__ import annotations

import os

from sinv_prune.deploy.errors import ExportRefused

#: ``type=`` name -> llama.cpp's ``LLAMA_FTYPE_*`` constant name.
K_QUANTS = {
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}


def require_quantizer(type: str) -> None:  # noqa: A002 - the name llama.cpp's tools use
    """Refuse a K-quant type before anything is written when llama-cpp-python is missing."""
    from sinv_prune.deploy.gguf_verify import PIP_HINT, llama_cpp_available

    if type in K_QUANTS and not llama_cpp_available():
        raise ExportRefused(f"type {type} is made by llama.cpp's quantiser, which needs llama-cpp-python: {PIP_HINT}")


def quantize(source: str | os.PathLike, target: str | os.PathLike, type: str, threads: int | None = None) -> None:  # noqa: A002
    """Quantize the float GGUF file ``source`` into ``target`` as ``type`` (one of :data:`K_QUANTS`)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, K_QUANTS[type])
    params.nthread = threads or max(1, os.cpu_count() or 1)
    with _quiet(llama_cpp):  # llama.cpp prints a line per tensor on the C streams
        code = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(target), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama.cpp's quantiser failed on {source} ({type}, return code {code})")


def _quiet(llama_cpp):
    """llama-cpp-python's own redirect of the C stdout/stderr (what ``Llama(verbose=False)`` uses)."""
    import contextlib

    try:
        from llama_cpp._utils import suppress_stdout_stderr
    except ImportError:
        return contextlib.nullcontext()
    return suppress_stdout_stderr(disable=False)
