"""Statistics of an unpruned model's consumers, measured one block at a time.

Per layer, the normal equations of the attention output projection and of the MLP down projection
against their own unpruned outputs (:class:`~sinv_prune.surgery.refit.ConsumerFit`; fit and held-out
sequences apart), from which OBS orders and refits of any cut follow without another pass, and each
block's influence (ShortGPT: ``1 - cos(input, output)``). A mixture-of-experts layer has no dense
down projection; its routed experts are scored instead, by REAP
(:class:`~sinv_prune.scoring.criteria.routing.ReapCriterion`) on the fit sequences.

The blocks are walked by :func:`~sinv_prune.surgery.layerwise.layer_by_layer`: block ``i`` alone
runs over every calibration batch with hooks on its consumers (and router / experts); its sums are
accumulated on the compute device, handed to ``on_layer`` (shrink computes its MLP OBS order there,
while they are on the device), then moved to a :class:`~sinv_prune.surgery.store.Store` on the host
(or disk) in ``dtype`` (float32 by default: ``scripts/check_statistics_dtype.py`` measures what float64
would change). Alive on the device at once: one block, its activations for one batch and its sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.scoring.criteria.routing import ReapCriterion, add_layer_sums, layer_hooks, layer_scores
from sinv_prune.surgery.block_inputs import rows
from sinv_prune.surgery.layerwise import Layer, layer_by_layer
from sinv_prune.surgery.refit import ConsumerFit, consumer_weights
from sinv_prune.surgery.store import Store
from sinv_prune.units.heads import HEADS
from sinv_prune.units.mlp import MLP

#: The dtypes the statistics may be stored in, by name.
DTYPES = {"float32": torch.float32, "float64": torch.float64}

Key = tuple[str, int]


def consumer_modules(adapter: HeadAdapter) -> dict[Key, nn.Module]:
    """Every layer's refitted consumers: ``o_proj`` (heads) and, in a dense layer, the down projection (MLP)."""
    out: dict[Key, nn.Module] = {}
    for i in range(adapter.num_layers):
        out |= layer_consumers(adapter, i)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != HEADS.name, kv[0][1])))


def layer_consumers(adapter: HeadAdapter, layer: int) -> dict[Key, nn.Module]:
    """Layer ``layer``'s refitted consumers: ``o_proj`` and, in a dense layer, the down projection."""
    out = {(HEADS.name, layer): adapter.out_proj(layer)}
    return out | ({} if adapter.num_experts(layer) else {(MLP.name, layer): adapter.mlp_out(layer)})


def statistics_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"float64"`` (or the dtype itself) as a dtype; anything else is a one-line error."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"statistics_dtype {value!r}: expected one of {', '.join(DTYPES)}")


class Statistics:
    """Per layer the fit / held-out :class:`ConsumerFit` of ``o_proj`` and the down projection; block influence;
    REAP scores of the routed experts.

    ``dtype`` is the dtype the sums are kept in (``"float32"`` or ``"float64"``); the products of each batch are
    float32 and a layer's sums are accumulated in ``accumulate`` (float64) while its block runs. ``store``:
    where they wait (default: host memory). ``on_layer(layer, fits)`` sees each layer's
    ``{key: (fit, held)}`` on the compute device, in ``dtype``, as :attr:`fits` will give them later.
    """

    def __init__(self, model: nn.Module, adapter: HeadAdapter, sequences: Sequence[torch.Tensor],
                 heldout: Sequence[bool], *, batch: int = 4, quiet: bool = False, dtype: str | torch.dtype = "float32",
                 accumulate: torch.dtype = torch.float64, store: Store | None = None,
                 on_layer: Callable[[int, dict], None] | None = None,
                 device: torch.device | str | None = None):  # fmt: skip
        n = adapter.num_layers
        self.dtype = statistics_dtype(dtype)
        self.store = store if store is not None else Store()
        #: ``{key: (in_features, bias, fit tokens, held-out tokens)}`` of every consumer measured.
        self.shapes: dict[Key, tuple[int, bool, int, int]] = {}
        self.influence = [0.0] * n
        #: Per layer the routed experts' REAP scores (higher: more useful), ``[]`` for a dense layer.
        self.expert_scores: list[list[float]] = [[] for _ in range(n)]
        groups = _batches(sequences, heldout, batch)
        held = [h for _, h in groups]
        # REAP reads the fit sequences (the first batch where every sequence is held out)
        reap_on = [j == 0 for j in range(len(groups))] if all(held) else [not h for h in held]
        criterion = ReapCriterion() if adapter.expert_counts() else None
        self.device = None
        calibration = [{"input_ids": ids} for ids, _ in groups]
        for layer in layer_by_layer(model, adapter, calibration, device=device, quiet=quiet, desc="statistics"):
            self.device = layer.device
            fits = self._measure(model, adapter, layer, held, reap_on, criterion, accumulate)
            if on_layer is not None:
                on_layer(layer.index, fits)
            for key, pair in fits.items():
                self.store.put(_name(key), {f"{part}.{k}": t for part, fit in zip(("fit", "held"), pair, strict=True)
                                            for k, t in fit.tensors().items()})  # fmt: skip
            del fits
        self.fits = _Fits(self)

    def _measure(self, model, adapter, layer: Layer, held, reap_on, criterion, accumulate) -> dict:
        """Run block ``layer`` over every batch with its hooks; its fits (in :attr:`dtype`, on the device)."""
        i, device = layer.index, layer.device
        fits: dict[Key, tuple[ConsumerFit, ConsumerFit]] = {}
        current = {"batch": -1}
        total, count = torch.zeros((), dtype=torch.float64, device=device), 0
        sums: dict = {"total": None}
        seen: dict[int, dict] = {}

        def start(module, args):
            current["batch"] += 1

        def consumer_hook(key):
            def hook(module, args, output):
                fits[key][int(held[current["batch"]])].update(rows(args[0], None), rows(output, None))

            return hook

        def only_reap_batches(hook):
            def wrapped(*args):
                if reap_on[current["batch"]]:
                    return hook(*args)

            return wrapped

        def on_output(j: int, x: torch.Tensor, y: torch.Tensor) -> None:
            nonlocal total, count
            cos = nn.functional.cosine_similarity(x.double(), y.double(), dim=-1)
            total += (1 - cos).sum()
            count += cos.numel()
            if i in seen:
                sums["total"] = add_layer_sums(sums["total"], seen.pop(i))

        with contextlib.ExitStack() as stack:
            stack.enter_context(_hooked(layer.block.register_forward_pre_hook(start)))
            for key, module in layer_consumers(adapter, i).items():
                weight, bias = consumer_weights(module)
                shape = (weight.shape[1], weight.shape[0])
                fits[key] = tuple(ConsumerFit(*shape, bias=bias is not None, device=device, dtype=accumulate,
                                              product_dtype=torch.float32) for _ in range(2))  # fmt: skip
                stack.enter_context(_hooked(module.register_forward_hook(consumer_hook(key))))
            if criterion is not None and adapter.num_experts(i):
                router, experts = layer_hooks(criterion, model, i, seen)
                if router is not None:
                    stack.enter_context(_hooked(adapter.router(i).register_forward_hook(only_reap_batches(router))))
                handle = adapter.experts(i).register_forward_pre_hook(only_reap_batches(experts), with_kwargs=True)
                stack.enter_context(_hooked(handle))
            layer.run(on_output)
        self.influence[i] = float(total) / max(count, 1)
        if sums["total"] is not None:
            self.expert_scores[i] = layer_scores(criterion, sums["total"])
        out = {}
        for key, (fit, ho) in fits.items():
            self.shapes[key] = (fit.in_features, fit.bias, fit.tokens, ho.tokens)
            out[key] = tuple(_cast(f, self.dtype) for f in (fit, ho))
        return out

    def pair(self, key: Key, device: torch.device | str | None = None,
             dtype: torch.dtype = torch.float64) -> tuple[ConsumerFit, ConsumerFit]:  # fmt: skip
        """``(fit, held)`` of consumer ``key`` brought to ``device`` (default: the compute device) in ``dtype``."""
        if key not in self.shapes:
            raise KeyError(f"no statistics of the {key[0]} consumer of layer {key[1]}")
        in_features, bias, fit_tokens, held_tokens = self.shapes[key]
        tensors = self.store.get(_name(key), device if device is not None else self.device, dtype)
        return tuple(ConsumerFit.from_tensors({k: tensors[f"{part}.{k}"] for k in ("gram", "cross", "target_sq")},
                                              in_features=in_features, bias=bias, tokens=tokens)
                     for part, tokens in (("fit", fit_tokens), ("held", held_tokens)))  # fmt: skip

    def bypass_order(self) -> list[int]:
        """Layers from the one that changes its input least (cheapest to drop) to the most."""
        return sorted(range(len(self.influence)), key=lambda i: self.influence[i])

    @property
    def nbytes(self) -> int:
        """Bytes the stored sums take (host memory or disk)."""
        return self.store.nbytes

    def close(self) -> None:
        """Free the stored sums (a disk store removes its files)."""
        self.store.close()


class _Fits(Mapping):
    """``stats.fits[key]``: ``(fit, held)`` of a consumer, loaded from the store on the compute device in float64."""

    def __init__(self, stats: Statistics):
        self.stats = stats

    def __getitem__(self, key: Key) -> tuple[ConsumerFit, ConsumerFit]:
        return self.stats.pair(key)

    def __iter__(self) -> Iterator[Key]:
        return iter(self.stats.shapes)

    def __len__(self) -> int:
        return len(self.stats.shapes)


def _name(key: Key) -> str:
    return f"{key[0]}.{key[1]}"


def _cast(fit: ConsumerFit, dtype: torch.dtype) -> ConsumerFit:
    return ConsumerFit.from_tensors({k: t.to(dtype) for k, t in fit.tensors().items()}, in_features=fit.in_features,
                                    bias=fit.bias, tokens=fit.tokens, product_dtype=fit.product_dtype)  # fmt: skip


def _batches(sequences, heldout, batch: int) -> list[tuple[torch.Tensor, bool]]:
    """Sequences stacked ``batch`` at a time (fit and held-out apart; equal lengths only share a batch)."""
    out = []
    for held in (False, True):
        run: list[torch.Tensor] = []
        for ids in (s for s, h in zip(sequences, heldout, strict=True) if h == held):
            if run and (len(run) == batch or ids.shape != run[0].shape):
                out.append((torch.stack(run), held))
                run = []
            run.append(ids)
        if run:
            out.append((torch.stack(run), held))
    return out


@contextlib.contextmanager
def _hooked(handle):
    try:
        yield handle
    finally:
        handle.remove()
