"""Least-squares refit of a consumer linear over its kept input columns.

The *consumer* of a prunable unit is the linear layer that reads it: the attention output
projection for heads (LLaMA ``o_proj``, GPT-2 ``attn.c_proj``, BERT ``attention.output.dense``),
the MLP down projection for channels (``down_proj``, GPT-2 ``mlp.c_proj``, BERT ``output.dense``).
Once units are gone the consumer sees only its kept columns ``X``; :class:`ConsumerFit`
accumulates the normal equations of ``min ||[X 1] [W b]^T - Y||^2`` over calibration tokens,
``Y`` being the unpruned consumer's output, so that a ridge solve gives the weights that best
reproduce it. Memory is O(width^2) whatever the number of tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from sinv_prune.arch.base import linear_weight


class ConsumerFit:
    """``G = [X 1]^T [X 1]``, ``C = [X 1]^T Y`` and ``|Y|^2`` of one consumer, accumulated batch by batch.

    ``bias`` adds the column of ones (fit a bias too). Statistics are summed in ``dtype``
    (float64 by default) on ``device``; each batch's products are computed in ``product_dtype``
    (default: ``dtype``; float32 is faster, and on consumer GPUs much faster). Rows are tokens.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device: torch.device,
        dtype=torch.float64,
        product_dtype=None,
    ):
        self.in_features, self.bias = in_features, bias
        self.product_dtype = product_dtype or dtype
        width = in_features + int(bias)
        self.gram = torch.zeros(width, width, dtype=dtype, device=device)
        self.cross = torch.zeros(width, out_features, dtype=dtype, device=device)
        self.target_sq = torch.zeros((), dtype=dtype, device=device)
        self.tokens = 0

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add tokens: ``x`` ``[n, in_features]`` (kept inputs), ``y`` ``[n, out_features]`` (target outputs).

        The products are computed in ``product_dtype`` and added to the ``dtype`` sums, so float32
        products (fast) lose only their own rounding, not the accumulation over many batches.
        """
        x, y = x.to(self.product_dtype), y.to(self.product_dtype)
        if self.bias:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
        if self.product_dtype == self.gram.dtype:
            self.gram.addmm_(x.T, x)
            self.cross.addmm_(x.T, y)
        else:
            self.gram += (x.T @ x).to(self.gram)
            self.cross += (x.T @ y).to(self.gram)
        self.target_sq += y.to(self.gram).square().sum()
        self.tokens += x.shape[0]

    def restrict(self, columns: torch.Tensor) -> ConsumerFit:
        """The statistics of the input columns ``columns`` only (the bias column kept), as a new fit."""
        index = columns.to(self.gram.device)
        if self.bias:
            index = torch.cat([index, index.new_tensor([self.in_features])])
        fit = ConsumerFit.__new__(ConsumerFit)
        fit.in_features, fit.bias, fit.product_dtype = columns.numel(), self.bias, self.product_dtype
        fit.gram = self.gram.index_select(0, index).index_select(1, index)
        fit.cross, fit.target_sq, fit.tokens = self.cross.index_select(0, index), self.target_sq, self.tokens
        return fit

    def __add__(self, other: ConsumerFit) -> ConsumerFit:
        """The statistics of both token sets together."""
        fit = ConsumerFit.__new__(ConsumerFit)
        fit.in_features, fit.bias, fit.product_dtype = self.in_features, self.bias, self.product_dtype
        fit.gram, fit.cross = self.gram + other.gram, self.cross + other.cross
        fit.target_sq, fit.tokens = self.target_sq + other.target_sq, self.tokens + other.tokens
        return fit

    def tensors(self) -> dict[str, torch.Tensor]:
        """The sums as ``{gram, cross, target_sq}`` (to store them; :meth:`from_tensors` rebuilds the fit)."""
        return {"gram": self.gram, "cross": self.cross, "target_sq": self.target_sq}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, in_features: int, bias: bool, tokens: int,
                     product_dtype=torch.float32) -> ConsumerFit:  # fmt: skip
        """A fit over the sums of :meth:`tensors` (summed further in their dtype)."""
        fit = cls.__new__(cls)
        fit.in_features, fit.bias, fit.product_dtype, fit.tokens = in_features, bias, product_dtype, tokens
        fit.gram, fit.cross, fit.target_sq = tensors["gram"], tensors["cross"], tensors["target_sq"]
        return fit

    def solve(self, weight: torch.Tensor, bias: torch.Tensor | None, ridge: float) -> tuple[torch.Tensor, ...]:
        """Ridge least squares pulled towards ``(weight, bias)`` (``[out, in]``, ``[out]``); returns the fit.

        Minimises ``|[X 1][W b]^T - Y|^2 + lam |W - weight|^2`` with ``lam = ridge x mean diag(X^T X)``;
        the bias is not penalised. Starting from the plainly pruned weights, the result never fits
        the calibration tokens worse than they do, and a large ``ridge`` returns them unchanged.
        """
        if not self.gram.numel():  # no columns and no bias: nothing to fit
            return weight, bias
        start = self._stack(weight, bias)
        features = self.in_features
        lam = ridge * self.gram.diagonal()[:features].mean() if features else 0.0
        system = self.gram.clone()
        system.diagonal()[:features] += lam
        rhs = self.cross - self.gram @ start  # solve for the step from the start
        factor, info = torch.linalg.cholesky_ex(system)
        if info.item() == 0:
            step = torch.cholesky_solve(rhs, factor)
        else:  # singular (ridge 0 and dependent columns): the smallest step that fits
            step = torch.linalg.pinv(system, hermitian=True) @ rhs
        fitted = (start + step).T
        return (fitted[:, :features], fitted[:, features]) if self.bias else (fitted, None)

    def relative_error(self, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
        """``|[X 1][W b]^T - Y| / |Y|`` (Frobenius norms over every token) for the given weights."""
        w = self._stack(weight, bias)
        err = (w * (self.gram @ w)).sum() - 2 * (w * self.cross).sum() + self.target_sq
        return float((err.clamp_min(0) / self.target_sq.clamp_min(torch.finfo(err.dtype).tiny)).sqrt())

    def _stack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[W b]^T`` as ``[in (+1), out]`` in the statistics' dtype."""
        w = weight.detach().to(self.gram).T
        if self.bias:
            b = bias.detach().to(self.gram) if bias is not None else w.new_zeros(w.shape[1])
            w = torch.cat([w, b[None]], dim=0)
        return w


def consumer_weights(module: nn.Module, root: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Linear's or Conv1D's ``([out, in] weight, bias or None)``, detached.

    With ``root`` (the model), weights an accelerate hook has offloaded (on ``meta``) are read from its
    weights map (:func:`~sinv_prune.surgery.offload.read_tensors`); without, they come as they are."""
    bias = getattr(module, "bias", None)
    if root is not None and module.weight.device.type == "meta":
        from sinv_prune.surgery.offload import read_tensors

        tensors = read_tensors(module, root)
        weight = tensors["weight"].t() if isinstance(module, Conv1D) else tensors["weight"]
        return weight, None if bias is None else tensors["bias"]
    return linear_weight(module).detach(), None if bias is None else bias.detach()


def write_consumer(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Give a Linear or Conv1D new ``[out, in]`` weights (and bias), as new parameters in its dtype and device.

    Parameters are replaced, not written in place, so a caller holding the old ones (the
    rollback of :func:`~sinv_prune.prune_heads`) keeps them intact.
    """
    old = module.weight
    value = weight.T if isinstance(module, Conv1D) else weight
    module.weight = nn.Parameter(value.to(old).contiguous(), requires_grad=old.requires_grad)
    if bias is not None:
        module.bias = nn.Parameter(bias.to(old).contiguous(), requires_grad=module.bias.requires_grad)
