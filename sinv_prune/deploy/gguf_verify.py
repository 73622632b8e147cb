"""Round-trip check of a written GGUF file: llama.cpp's logits against transformers' on the same tokens.

llama.cpp is loaded here (:func:`load_llama`; its quantiser is called from
:mod:`~sinv_prune.deploy.gguf_quantize`). The
file is loaded with ``logits_all=True`` and a **float32 KV cache** (llama.cpp's default f16 cache
alone moves SmolLM2-135M's logits by ~1e-3, a hundred times what float32 kernels differ by), the
tokens are evaluated in one batch, and every position's next-token logits are compared with the
model's own forward pass, relative to the largest logit at that position. A float32 file of a
float32 model must agree within its architecture's :func:`tolerance` at the median and the worst
position and give the same arg-max wherever the reference's top two logits are further apart than
that: llama.cpp's float32 kernels sum in another order, which measured a few 1e-6 on SmolLM2
unpruned and cut (``scripts/gguf_agreement.py``, docs/deploy.md), while a single weight matrix
perturbed by 1e-4 of its size moves them by several times more. Files stored in other types report
their agreement and are not judged: their weights are rounded, so they differ from the model by
design (docs/deploy.md has the measured figures per type).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

PIP_HINT = "pip install llama-cpp-python (or sinv_prune[deploy]); it builds llama.cpp from source"
DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
#: ggml's type id for float32, as llama.cpp's ``type_k`` / ``type_v`` take it.
GGML_TYPE_F32 = 0


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load_llama(
    path: str | os.PathLike,
    n_ctx: int = 512,
    logits_all: bool = True,
    n_threads: int | None = None,
    f32_cache: bool = True,
):
    """A ``llama_cpp.Llama`` for ``path`` on the CPU, quiet, or ImportError naming the pip command.

    ``f32_cache``: keep the KV cache in float32 (llama.cpp's default is f16). The weights stay in
    plain CPU buffers (no AMX or repacked copies): ggml's AMX kernels fault where the operating
    system does not grant AMX state (seen in virtual machines that report the CPU flags), and the
    plain kernels are what every CPU runs.
    """
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(f"verifying or benchmarking a GGUF file needs llama-cpp-python: {PIP_HINT}") from None
    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_cache else {}
    with _plain_buffers(llama_cpp):
        return llama_cpp.Llama(
            model_path=os.fspath(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            logits_all=logits_all,
            n_gpu_layers=0,
            n_threads=n_threads or max(1, (os.cpu_count() or 1)),
            verbose=False,
            **cache,
        )


@contextlib.contextmanager
def _plain_buffers(llama_cpp):
    """``Llama`` does not expose ``use_extra_bufts``; its model parameters come from this one function."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` for one sequence, evaluated from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


@dataclass
class VerifyResult:
    """How a GGUF file's logits compare with transformers' on ``tokens`` positions.

    ``off_positions``: the positions (0-based) past the tolerance or with another arg-max (f32 only).
    """

    tokens: int
    max_rel_diff: float
    median_rel_diff: float
    top1_agreement: float
    exact_type: bool
    rtol: float
    passed: bool
    worst_rtol: float = 0.0
    worst_position: int = 0
    off_positions: list[int] = field(default_factory=list)
    kv_cache: str = "f32"

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        diff = f"rel. logit diff median {self.median_rel_diff:.1e}, max {self.max_rel_diff:.1e}"
        judged = f"tol {self.rtol:g} / {self.worst_rtol:g}" if self.exact_type else "weights rounded: not judged"
        what = f"{diff} ({judged}), "
        return (
            f"llama.cpp round trip {verdict}: {what}top-1 agreement {self.top1_agreement:.1%} over {self.tokens} "
            f"tokens ({self.kv_cache} KV cache)"
        )

    def failure(self) -> str:
        """One line: which positions are off and by how much (empty when passed)."""
        if self.passed:
            return ""
        shown = ", ".join(map(str, self.off_positions[:8])) + (", ..." if len(self.off_positions) > 8 else "")
        return (
            f"{len(self.off_positions)} of {self.tokens} positions past {self.worst_rtol:g}"
            + (f" (positions {shown})" if shown else "")
            + f", median {self.median_rel_diff:.2e} (tolerance {self.rtol:g}), worst position {self.worst_position} "
            f"by {self.max_rel_diff:.2e} of its largest logit; top-1 agreement {self.top1_agreement:.1%}"
        )


def reference_logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    """transformers' logits for one sequence, float32, on the model's device."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids], device=device))
    finally:
        model.train(was_training)
    return out.logits[0].float().cpu().numpy()


def tolerance(arch: str) -> tuple[float, float]:
    """The float32 rule for llama.cpp's ``arch``: (median, worst) relative logit difference allowed.

    Measured with ``scripts/gguf_agreement.py`` (docs/deploy.md): llama files of SmolLM2 unpruned and
    cut differ by a median of 1.5-6.3e-6 and at worst 3.8e-5; one weight matrix perturbed by 1e-4 of
    its size moves the median by 1.2-2.4e-5, depending on the input. The MoE architectures (qwen3moe,
    qwen2moe, olmoe, llama with experts) keep the same rule: ``scripts/gguf_agreement_moe.py`` measured
    medians of 5.4-8.0e-7 on seeded random models, unpruned and cut. gpt2's rule is looser because
    llama.cpp's GELU reads an f16 table; the round-trip tests hold every architecture to its rule.
    """
    from sinv_prune.deploy.archs import get_arch

    return get_arch(arch).f32_tolerance


def compare(
    reference: np.ndarray, got: np.ndarray, exact_type: bool, rtol: float = 1.5e-5, worst_rtol: float = 2e-4
) -> VerifyResult:
    """Per position: max |diff| relative to the largest |logit|; arg-max agreement.

    Exact types pass when the median position is within ``rtol``, every position within
    ``worst_rtol``, and every position has the reference's arg-max, except where the reference's top
    two logits are themselves within ``worst_rtol`` (a tie either side may break).
    """
    scale = np.maximum(np.abs(reference).max(axis=-1), 1e-6)
    rel = np.abs(reference - got).max(axis=-1) / scale
    same = reference.argmax(-1) == got.argmax(-1)
    top2 = np.sort(reference, axis=-1)[:, -2:] if reference.shape[-1] > 1 else np.zeros((len(rel), 2))
    tie = (top2[:, 1] - top2[:, 0]) / scale <= worst_rtol
    off = np.flatnonzero((rel > worst_rtol) | ~(same | tie)) if exact_type else np.array([], dtype=int)
    median = float(np.median(rel))
    return VerifyResult(
        tokens=len(rel),
        max_rel_diff=float(rel.max()),
        median_rel_diff=median,
        top1_agreement=float(same.mean()),
        exact_type=exact_type,
        rtol=rtol,
        worst_rtol=worst_rtol,
        passed=not exact_type or (len(off) == 0 and median <= rtol),
        worst_position=int(rel.argmax()),
        off_positions=[int(i) for i in off],
    )


def verify_gguf(
    path: str | os.PathLike,
    model: nn.Module,
    ids: list[int],
    *,
    exact_type: bool,
    arch: str = "llama",
    continue_tokens: int = 0,
    tokenizer=None,
) -> VerifyResult:
    """Load ``path`` in llama.cpp (float32 KV cache), evaluate ``ids`` and compare every position with ``model``.

    ``arch``: the file's llama.cpp architecture, which picks the float32 rule (:func:`tolerance`).

    ``continue_tokens > 0`` also continues ``ids`` greedily on both sides (decoded with ``tokenizer``).
    """
    llm = load_llama(path, n_ctx=max(64, len(ids) + continue_tokens + 1))
    try:
        got = llama_logits(llm, ids)
        ours = greedy_llama(llm, ids, continue_tokens) if continue_tokens else None
    finally:
        llm.close()
    result = compare(reference_logits(model, ids), got, exact_type, *tolerance(arch))
    if ours is not None:
        theirs = greedy_reference(model, ids, continue_tokens)
        show = (lambda t: tokenizer.decode(t)) if tokenizer is not None else str
        result.continuation_transformers, result.continuation_llama_cpp = show(theirs), show(ours)
    return result


def greedy_llama(llm, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids`` in llama.cpp (arg-max of its logits, no sampler)."""
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def greedy_reference(model: nn.Module, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids`` in transformers (full forwards: no cache, no stopping token)."""
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(reference_logits(model, seq)[-1].argmax()))
    return seq[len(ids) :]


def prompt_ids(tokenizer, vocab_size: int, length: int = 24) -> list[int]:
    """Token ids of a short fixed prompt (a fixed id sequence when there is no tokenizer)."""
    if tokenizer is not None:
        ids = tokenizer(DEFAULT_PROMPT, add_special_tokens=False)["input_ids"]
        if ids:
            return list(ids)[:length]
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab_size, size=length).tolist()
