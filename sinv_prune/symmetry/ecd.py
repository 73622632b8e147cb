"""Energy Conserving Descent, the ``ECD_{q=1}`` variant (De Luca et al., arXiv 2501.18419), as
used by the symmetry-breaking paper's code.

With ``D`` parameters, loss ``F`` and an offset ``F0`` below every loss the run reaches, a
unit "momentum" ``p`` (one tensor per parameter, normalised over all of them together)
moves on the sphere and drives the parameters ``theta``:

* first step: ``p = -g / ||g||``;
* every step with ``F - F0 > eps`` (otherwise nothing moves), ``dt = lr / sqrt(eta)``:

  - ``p <- p / ||p||``
  - per tensor ``T``: ``p_T <- p_T - dt * eta * D / (2 (D - 1)) * (g_T - p_T (p_T . g_T)) / (F - F0)``
  - ``theta <- theta + dt * p``
  - ``p <- p / ||p|| + (nu / sqrt(D)) z``, ``z ~ N(0, I)``, renormalised to ``||p|| = 1``.

The parameters move by ``dt`` times the momentum after its update and before it is renormalised,
so a step is ``dt * ||p_new||`` long, not ``dt``. With one tensor ``p_new = p - c g_perp``
(``g_perp = g - p (p . g)`` is orthogonal to the unit ``p``, ``c = dt eta D / (2 (D - 1) (F - F0))``),
so the step is ``dt * sqrt(1 + c^2 ||g_perp||^2)``: at least ``dt``, and longer the closer ``F``
comes to ``F0``. With several tensors the per-tensor projection can also make it slightly shorter
than ``dt``.

As in the authors' code, the projection ``p_T (p_T . g_T)`` is taken per tensor, the norms
over all tensors. ``weight_decay`` is an L2 term: ``F + wd/2 ||theta||^2`` and ``g + wd theta``
(per parameter group). Parameters without a gradient in a step are left alone; ``D`` still
counts every parameter given to the optimizer.

The update needs the loss value, so :meth:`ECD.step` requires a closure (it returns the
closure's loss); with ``transformers.Trainer`` use :class:`sinv_prune.symmetry.ClosureTrainer`.
State: one momentum tensor per parameter (AdamW keeps two).
"""

from __future__ import annotations

import logging
import math

import torch
from torch.optim import Optimizer

_GLOBAL = ("eta", "F0", "nu", "eps")

logger = logging.getLogger(__name__)  # a child of "sinv_prune": reaches a recipe run's run.log and console


class ECD(Optimizer):
    """``ECD_{q=1}``; defaults are the paper code's (``lr=1, eta=100, F0=2, nu=0``).

    ``F0`` must stay below every loss the run reaches: a step with ``F - F0 <= eps`` does
    nothing (the first such step logs a warning with the numbers). ``seed`` makes the ``nu``
    noise reproducible; without it the noise comes from torch's global generator. ``lr`` and
    ``weight_decay`` may differ per parameter group (a scheduler may change ``lr``); ``eta``,
    ``F0``, ``nu`` and ``eps`` are global.

    A step whose loss is NaN or infinite moves nothing (the momentum stays as it was); the
    optimizer counts such steps in :attr:`nonfinite_steps`, warns at the first, and raises
    ``FloatingPointError`` when there are more than ``max_nonfinite_steps`` (default 10), which
    stops a training run with that message instead of letting it end on silently skipped steps.
    """

    #: Tells :class:`~sinv_prune.symmetry.ClosureTrainer` (and readers) that ``step`` needs the loss.
    requires_loss = True

    def __init__(
        self,
        params,
        lr: float = 1.0,
        eta: float = 100.0,
        F0: float = 2.0,  # noqa: N803  (the paper's name)
        nu: float = 0.0,
        weight_decay: float = 0.0,
        eps: float = 1e-10,
        seed: int | None = None,
        max_nonfinite_steps: int = 10,
    ):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not eta > 0:
            raise ValueError(f"eta must be > 0, got {eta}")
        if not nu >= 0:
            raise ValueError(f"nu must be >= 0, got {nu}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not math.isfinite(F0):
            raise ValueError(f"F0 must be finite, got {F0}")
        if not (isinstance(max_nonfinite_steps, int) and max_nonfinite_steps >= 0):
            raise ValueError(f"max_nonfinite_steps must be an integer >= 0, got {max_nonfinite_steps!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, eta=eta, F0=F0, nu=nu, eps=eps)
        super().__init__(params, defaults)
        self.seed = seed
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0
        self._steps = 0
        self._warned_stop = False
        self._generators: dict[torch.device, torch.Generator] = {}
        if self.dim < 2:
            raise ValueError(f"ECD needs at least 2 parameters (D/(D-1) in the update), got {self.dim}")

    @property
    def dim(self) -> int:
        """``D``: every parameter entry given to the optimizer."""
        return sum(p.numel() for group in self.param_groups for p in group["params"])

    def _global(self) -> dict:
        values = {k: self.param_groups[0][k] for k in _GLOBAL}
        for group in self.param_groups[1:]:
            for k in _GLOBAL:
                if group[k] != values[k]:
                    raise ValueError(f"ECD's {k} is global; parameter groups disagree ({values[k]} vs {group[k]})")
        return values

    def _noise(self, p: torch.Tensor) -> torch.Tensor:
        gen = None
        if self.seed is not None:
            gen = self._generators.get(p.device)
            if gen is None:
                gen = self._generators[p.device] = torch.Generator(device=p.device).manual_seed(self.seed)
        return torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One ECD step; ``closure`` (required) re-evaluates the model and returns the loss."""
        if closure is None:
            raise RuntimeError(
                "ECD needs the loss value: call step(closure) with a closure that returns the loss "
                "(with transformers.Trainer, train with sinv_prune.symmetry.ClosureTrainer)"
            )
        with torch.enable_grad():
            loss = closure()
        hp = self._global()
        eta, F0, nu, eps = hp["eta"], hp["F0"], hp["nu"], hp["eps"]  # noqa: N806
        D = self.dim  # noqa: N806

        F = float(loss.detach() if torch.is_tensor(loss) else loss)  # noqa: N806
        self._steps += 1
        if not math.isfinite(F):
            self._skip_nonfinite(F)
            return loss
        device = self.param_groups[0]["params"][0].device
        moving = []  # (param, group) for parameters with a gradient
        decay = []  # wd/2 ||theta||^2 per group, as tensors (one sync below)
        for group in self.param_groups:
            wd = group["weight_decay"]
            if wd:
                decay += [0.5 * wd * _wide(p).pow(2).sum().to(device) for p in group["params"]]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ECD does not support sparse gradients")
                moving.append((p, group))
        if decay:
            F += float(torch.stack(decay).sum())  # noqa: N806
        if not moving:
            return loss

        # First step: p = -g/||g||; a parameter whose gradient appears later starts at rest.
        if all("momentum" not in self.state[p] for p, _ in moving):
            for p, group in moving:
                self.state[p]["momentum"] = _gradient(p, group).neg().to(p.dtype)
            _normalise([self.state[p]["momentum"] for p, _ in moving])
        for p, _ in moving:
            if "momentum" not in self.state[p]:
                self.state[p]["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

        gap = F - F0
        if not gap > eps:  # also catches a NaN weight-decay term
            if gap <= eps:
                self._warn_stopped(F, F0, eps)
            return loss
        momenta = [self.state[p]["momentum"] for p, _ in moving]
        _normalise(momenta)
        for (p, group), m in zip(moving, momenta, strict=True):
            dt = group["lr"] / math.sqrt(eta)
            c = dt * eta * D / (2 * (D - 1)) / gap
            g = _gradient(p, group).to(m.dtype)
            dot = torch.dot(m.reshape(-1), g.reshape(-1))
            # p - c (g - p (p.g)) = p (1 + c p.g) - c g
            m.mul_(1 + c * dot).sub_(g, alpha=c)
            p.add_(m.to(p.dtype), alpha=dt)
        _normalise(momenta)
        if nu > 0:
            for m in momenta:
                m.add_(self._noise(m), alpha=nu / math.sqrt(D))
            _normalise(momenta)
        return loss

    def _skip_nonfinite(self, F: float) -> None:  # noqa: N803
        """Count a step skipped for a NaN / infinite loss; warn at the first, raise past the limit."""
        self.nonfinite_steps += 1
        if self.nonfinite_steps > self.max_nonfinite_steps:
            raise FloatingPointError(
                f"ECD: the loss was NaN or infinite in {self.nonfinite_steps} of {self._steps} steps (more than "
                f"max_nonfinite_steps={self.max_nonfinite_steps}), each skipped; the run stops here. Check the data "
                "and the model for non-finite values, or lower the learning rate (recipe: optimizer_args: "
                "{lr: ..., max_nonfinite_steps: ...})"
            )
        if self.nonfinite_steps == 1:
            logger.warning(
                "ECD skipped step %d: the loss is %s. Skipped steps are counted; more than %d stop the run.",
                self._steps, F, self.max_nonfinite_steps,
            )  # fmt: skip

    def _warn_stopped(self, F: float, F0: float, eps: float) -> None:  # noqa: N803
        """Say once, with the numbers, that a step did nothing because ``F - F0 <= eps``."""
        if self._warned_stop:
            return
        self._warned_stop = True
        logger.warning(
            "ECD did not move: the loss F = %.6g is at or below F0 + eps = %g + %g, and no step moves the "
            "parameters while F - F0 <= eps (with the same batch, never again). Set F0 below the lowest loss "
            "the run can reach (recipe: optimizer_args: {F0: ...}; 0 for a cross-entropy loss).",
            F, F0, eps,
        )  # fmt: skip


def _gradient(p: torch.Tensor, group: dict) -> torch.Tensor:
    """``g + wd * theta`` (the gradient of the L2-regularised loss)."""
    wd = group["weight_decay"]
    return p.grad.add(p, alpha=wd) if wd else p.grad


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (float64 stays float64), for sums of squares."""
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


def _normalise(tensors: list[torch.Tensor]) -> None:
    """Divide every tensor by the norm of all of them together (no-op when that norm is 0)."""
    device = tensors[0].device
    total = torch.stack([_wide(t).pow(2).sum().to(device) for t in tensors]).sum().sqrt()
    if float(total) > 0:
        for t in tensors:
            t.div_(total.to(t.device, t.dtype))
