"""Round-trip check of a written GGUF file: llama.cpp's logits against transformers' on the same tokens.

llama-cpp-python is the one import site of llama.cpp in this project (:func:`load_llama`). The
file is loaded with ``logits_all=True``, the tokens are evaluated in one batch, and every
position's next-token logits are compared with the model's own forward pass: float32 files must
agree within ``rtol`` at the median position and within ``WORST * rtol`` at the worst (each relative
to the largest logit at that position), and give the same arg-max everywhere; quantized files report
top-1 agreement. The worst-position slack is measured, not a guess: llama.cpp's float32 kernels sum
in another order, and the *unpruned* SmolLM2-135M already differs from transformers by 8.4e-4 at its
worst position (median 3e-4); a wrong tensor (a missing RoPE scaling, a mis-permuted head) is off by
several times more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

PIP_HINT = "pip install llama-cpp-python (or sinv_prune[deploy]); it builds llama.cpp from source"
DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load_llama(path: str | os.PathLike, n_ctx: int = 512, logits_all: bool = True, n_threads: int | None = None):
    """A ``llama_cpp.Llama`` for ``path`` on the CPU, quiet, or ImportError naming the pip command."""
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(f"verifying or benchmarking a GGUF file needs llama-cpp-python: {PIP_HINT}") from None
    return llama_cpp.Llama(
        model_path=os.fspath(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=logits_all,
        n_gpu_layers=0,
        n_threads=n_threads or max(1, (os.cpu_count() or 1)),
        verbose=False,
    )


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` for one sequence, evaluated from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


@dataclass
class VerifyResult:
    """How a GGUF file's logits compare with transformers' on ``tokens`` positions."""

    tokens: int
    max_rel_diff: float
    median_rel_diff: float
    top1_agreement: float
    exact_type: bool
    rtol: float
    passed: bool

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        what = (
            f"rel. logit diff median {self.median_rel_diff:.2e} (tol {self.rtol:g}), max {self.max_rel_diff:.2e} "
            f"(tol {WORST * self.rtol:g}), "
            if self.exact_type
            else ""
        )
        return (
            f"llama.cpp round trip {verdict}: {what}top-1 agreement {self.top1_agreement:.1%} over {self.tokens} tokens"
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


#: The worst position may differ by this many times ``rtol`` (the median must stay within ``rtol``).
WORST = 3.0


def compare(reference: np.ndarray, got: np.ndarray, exact_type: bool, rtol: float = 1e-3) -> VerifyResult:
    """Per position: max |diff| relative to the largest |logit|; arg-max agreement."""
    scale = np.maximum(np.abs(reference).max(axis=-1), 1e-6)
    rel = np.abs(reference - got).max(axis=-1) / scale
    top1 = float((reference.argmax(-1) == got.argmax(-1)).mean())
    passed = bool(np.median(rel) <= rtol and rel.max() <= WORST * rtol and top1 == 1.0) if exact_type else True
    return VerifyResult(len(rel), float(rel.max()), float(np.median(rel)), top1, exact_type, rtol, passed)


def verify_gguf(
    path: str | os.PathLike,
    model: nn.Module,
    ids: list[int],
    *,
    exact_type: bool,
    rtol: float = 1e-3,
    continue_tokens: int = 0,
    tokenizer=None,
) -> VerifyResult:
    """Load ``path`` in llama.cpp, evaluate ``ids`` and compare every position with ``model``.

    ``continue_tokens > 0`` also continues ``ids`` greedily on both sides (decoded with ``tokenizer``).
    """
    llm = load_llama(path, n_ctx=max(64, len(ids) + continue_tokens + 1))
    try:
        got = llama_logits(llm, ids)
        ours = greedy_llama(llm, ids, continue_tokens) if continue_tokens else None
    finally:
        llm.close()
    result = compare(reference_logits(model, ids), got, exact_type, rtol)
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
