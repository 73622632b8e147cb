"""Weight magnitude per head: the classic data-free baseline (the paper's "magnitude pruning")."""

from __future__ import annotations

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.arch.base import linear_weight
from sinv_prune.scoring.criteria.base import Criterion, Scores
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.units import get_unit
from sinv_prune.units.experts import EXPERTS
from sinv_prune.units.mlp import MLP


@register_criterion("magnitude")
class MagnitudeCriterion(Criterion):
    """The ``p``-norm of all weights a head owns: its Q rows, K and V rows, and O columns.

    Score of head ``h`` = ``||concat(W_Q^h, W_K^h, W_V^h, W_O^h)||_p`` (biases excluded),
    so ``p=2`` is ``sqrt(sum of squared Frobenius norms)`` and ``p=1`` the sum of absolute
    values. Under GQA the K and V slices are those of the KV head serving ``h`` (shared
    by its group). Computed in float32 (float64 for float64 models).

    ``unit="mlp"``: channel ``j`` owns row ``j`` of every module feeding the channels
    (``adapter.mlp_in``: gate and up for gated MLPs) and column ``j`` of the down projection;
    its score is the ``p``-norm of those weights together (biases excluded). On a mixture-of-experts
    layer the channels are those inside its experts (see :mod:`sinv_prune.units.mlp`): routed expert
    ``e``'s channel ``c`` owns its gate and up rows of ``gate_up_proj[e]`` and column ``c`` of
    ``down_proj[e]``; the shared expert's channels score like a dense MLP's.

    ``unit="experts"``: the ``p``-norm of the routed expert's own weights (its gate, up and down
    projections, biases excluded; the router's row for it is left out, as it scores how often the expert is
    picked rather than what it computes). Dense layers get ``[]``.

    .. code-block:: yaml

        criterion: magnitude
        options: {p: 2}
    """

    units = ("heads", "mlp", "experts")

    def __init__(self, p: float = 2):
        if p not in (1, 2):
            raise ValueError(f"magnitude: p must be 1 or 2, got {p!r}")
        self.p = p

    def scores(self, model: nn.Module) -> Scores:
        adapter = get_adapter(model)
        if get_unit(self.unit) is MLP:
            return [_channel_scores(adapter, layer, self.p) for layer in range(adapter.num_layers)]
        if get_unit(self.unit) is EXPERTS:
            return [_expert_scores(adapter, layer, self.p) for layer in range(adapter.num_layers)]
        out = []
        with torch.no_grad():
            for layer in range(adapter.num_layers):
                layout = adapter.layout(layer)
                if layout.num_heads == 0:
                    out.append([])
                    continue
                w = adapter.projections(layer)
                out.append(_layer_scores(w, layout.num_heads, layout.group_size, layout.head_dim, self.p))
        return out


def _layer_scores(w, heads: int, group: int, head_dim: int, p: float) -> list[float]:
    dtype = torch.float64 if w.q.dtype == torch.float64 else torch.float32

    def per_head(t: torch.Tensor, n: int) -> torch.Tensor:  # [n*d, D] -> [n] of sum |x|^p
        return t.detach().to(dtype).abs().pow(p).reshape(n, head_dim, -1).sum(dim=(1, 2))

    kv = per_head(w.k, heads // group) + per_head(w.v, heads // group)
    total = per_head(w.q, heads) + per_head(w.o.t(), heads) + kv.repeat_interleave(group)
    return [float(x) for x in total.pow(1 / p).double().cpu()]


def _channel_scores(adapter, layer: int, p: float) -> list[float]:
    """``||rows j of mlp_in, column j of mlp_out||_p`` per channel ``j``; a MoE layer's expert channels
    expert-major, then its shared expert's."""
    if adapter.num_experts(layer):
        return _expert_channel_scores(adapter, layer, p)
    return _dense_scores(adapter.mlp_in(layer), adapter.mlp_out(layer), p)


def _expert_channel_scores(adapter, layer: int, p: float) -> list[float]:
    """Channel ``c`` of routed expert ``e``: ``||W_gate^e[c], W_up^e[c], W_down^e[:, c]||_p`` (``expert_weights``,
    biases excluded), expert-major; then the shared expert's channels."""
    with torch.no_grad():
        gate, up, down = (w.detach() for w in adapter.expert_weights(layer))  # [E, I, H], [E, I, H], [E, H, I]
        dtype = torch.float64 if gate.dtype == torch.float64 else torch.float32
        total = sum(w.to(gate.device, dtype).abs().pow(p).sum(2) for w in (gate, up))
        total = total + down.to(gate.device, dtype).abs().pow(p).sum(1)  # [E, I]
        out = [float(x) for x in total.pow(1 / p).flatten().double().cpu()]
    shared = adapter.shared_expert(layer)
    if shared is not None:
        out += _dense_scores([shared.gate_proj, shared.up_proj], shared.down_proj, p)
    return out


def _dense_scores(inputs, output, p: float) -> list[float]:
    down = linear_weight(output).detach()  # [D, I]
    dtype = torch.float64 if down.dtype == torch.float64 else torch.float32
    total = down.to(dtype).abs().pow(p).sum(0)
    for module in inputs:
        total = total + linear_weight(module).detach().to(total.device, dtype).abs().pow(p).sum(1)
    return [float(x) for x in total.pow(1 / p).double().cpu()]


def _expert_scores(adapter, layer: int, p: float) -> list[float]:
    """``||W_gate^e, W_up^e, W_down^e||_p`` per routed expert ``e`` (``adapter.expert_weights``, biases
    excluded); ``[]`` for a dense layer."""
    if not adapter.num_experts(layer):
        return []
    with torch.no_grad():
        weights = [w.detach() for w in adapter.expert_weights(layer)]
        dtype = torch.float64 if weights[0].dtype == torch.float64 else torch.float32
        device = weights[0].device
        total = sum(w.to(device, dtype).abs().pow(p).flatten(1).sum(1) for w in weights)
    return [float(x) for x in total.pow(1 / p).double().cpu()]
