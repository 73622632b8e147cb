"""Symmetry-breaking query and value biases (Silverstein, Kunin, Shyam: "Symmetry Breaking in
Transformers for Efficient and Interpretable Training").

Attention is unchanged by ``W_Q^h -> R W_Q^h, W_K^h -> R W_K^h`` (R orthogonal) and by
``W_V^h -> B W_V^h, W_O^h -> W_O^h B^-1``. A fixed, *unlearned* direction added to every
query and value breaks these rotations: per layer one ``d_head`` vector ``b_Q`` is added to
the query of every head and one ``b_V`` to the value of every head (every KV head under
grouped-query attention), ``q <- q + b_Q``, ``v <- v + b_V``. In training mode both are
redrawn on every forward pass of the model; in evaluation mode their mean ``E[b]`` is used,
so evaluation is deterministic. A key bias would cancel in the softmax and is not offered.

The biases live in buffers, never in parameters (a learned bias rotates along with the
weights and the symmetry survives). They are applied by forward hooks on the projection
modules, so the attention implementation (eager, sdpa, flash) does not matter:

* GPT-2: the fused ``c_attn`` output gets ``b_Q`` on its query columns and ``b_V`` on its
  value columns;
* BERT family: the ``query`` and ``value`` linears;
* LLaMA family: ``q_proj`` and ``v_proj``. Where the attention normalises queries per head
  (``q_norm``, Qwen3) a query bias would have to follow the norm, where no checkpoint can hold
  it, so only ``b_V`` is offered there.

Under rotary position embeddings the query bias is added before the rotation (there is no
projection output after it), so at relative offset ``r`` a key meets ``R_r b_Q``; at offset 0
the bias is exactly ``b_Q``.

Head counts are read from the projection output at every call, so pruned models (different
head counts per layer) work, before or after :func:`sinv_prune.prune_heads`.

The setting is recorded in ``config.sinv_symmetry`` so a saved checkpoint carries it, and every
``state_dict()`` holds ``E[b_Q]`` and ``E[b_V]`` folded into the projection biases
(:mod:`sinv_prune.symmetry.folding`), so every reload route gives the evaluation outputs of the
saved model; :func:`restore_symmetry_breaking` (called by :func:`sinv_prune.from_pretrained`)
unfolds them and re-adds the hooks. The buffers are non-persistent: the config holds everything
they need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.symmetry.folding import (
    FoldOnSave,
    UnfoldOnLoad,
    drop_zero_attention_biases,
    fold_plan,
    unfold_parameters,
)
from sinv_prune.version import __version__

CONFIG_KEY = "sinv_symmetry"
CONFIG_TYPE = "sinv_prune.symmetry_breaking"
_HANDLE_ATTR = "_sinv_symmetry_handle"
_DISTS = ("normal", "uniform", "constant")
_BUFFERS = ("sinv_b_{}", "sinv_b_{}_mean", "sinv_b_{}_std")


@dataclass(frozen=True)
class BiasDistribution:
    """The distribution of one bias vector (``d_head`` entries, shared by every head of a layer).

    ``dist``: ``"normal"`` (``mean + std * N(0, 1)`` per entry), ``"uniform"`` (same mean and
    standard deviation, ``mean + std * U(-sqrt 3, sqrt 3)``) or ``"constant"`` (always ``mean``).
    ``mean`` and ``std`` are a number (every entry) or a sequence of ``d_head`` numbers;
    ``std_linspace=(lo, hi)`` sets the per-entry std to ``linspace(lo, hi, d_head)`` instead.
    ``E[b]`` is ``mean`` in every case.
    """

    dist: str = "normal"
    mean: float | tuple[float, ...] = 0.5
    std: float | tuple[float, ...] = 0.05
    std_linspace: tuple[float, float] | None = None

    def __post_init__(self):
        if self.dist not in _DISTS:
            raise ValueError(f"dist must be one of {', '.join(_DISTS)}, got {self.dist!r}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)):
                object.__setattr__(self, name, tuple(float(v) for v in value))
        if self.std_linspace is not None:
            lo_hi = tuple(float(v) for v in self.std_linspace)
            if len(lo_hi) != 2:
                raise ValueError(f"std_linspace must be (lo, hi), got {self.std_linspace!r}")
            object.__setattr__(self, "std_linspace", lo_hi)
        stds = self.std_linspace or (self.std if isinstance(self.std, tuple) else (self.std,))
        if any(not math.isfinite(s) or s < 0 for s in stds):
            raise ValueError(f"standard deviations must be finite and >= 0, got {stds}")

    @classmethod
    def coerce(cls, value) -> BiasDistribution | None:
        """``None``, a :class:`BiasDistribution`, or a mapping of its fields (as stored in a config)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown bias distribution fields {sorted(unknown)}")
            return cls(**value)
        raise TypeError(f"expected a BiasDistribution, a mapping or None, got {type(value).__name__}")

    def vectors(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, std)`` as float32 vectors of length ``head_dim``."""

        def vec(value, name):
            t = torch.as_tensor(value, dtype=torch.float32)
            if t.ndim == 0:
                return t.repeat(head_dim)
            if t.shape != (head_dim,):
                raise ValueError(f"{name} has {t.numel()} entries but the heads have head_dim={head_dim}")
            return t.clone()

        std = torch.linspace(*self.std_linspace, head_dim) if self.std_linspace else vec(self.std, "std")
        return vec(self.mean, "mean"), std

    def to_json(self) -> dict:
        data = asdict(self)
        for k, v in data.items():
            if isinstance(v, tuple):
                data[k] = list(v)
        return data


#: Paper-code defaults: ``b_Q ~ N(0.5, diag(linspace(0.05, 0.15, d_head))^2)``, ``b_V ~ N(0.5, 0.05^2 I)``.
DEFAULT_B_Q = BiasDistribution(mean=0.5, std_linspace=(0.05, 0.15))
DEFAULT_B_V = BiasDistribution(mean=0.5, std=0.05)


@dataclass
class SymmetryBreakingConfig:
    """What :func:`add_symmetry_breaking` added; stored as JSON in ``config.sinv_symmetry``."""

    b_q: BiasDistribution | None = DEFAULT_B_Q
    b_v: BiasDistribution | None = DEFAULT_B_V
    seed: int | None = None
    #: checkpoints hold ``E[b]`` folded into the projection biases (False: written before folding existed)
    folded: bool = True
    #: ``config.attention_bias`` was turned on to give the folded means a place (LLaMA, Qwen3)
    attention_bias_added: bool = False
    type: str = field(default=CONFIG_TYPE)
    version: str = field(default=__version__)

    def to_json(self) -> dict:
        return {
            "type": CONFIG_TYPE,
            "version": __version__,
            "b_q": self.b_q.to_json() if self.b_q else None,
            "b_v": self.b_v.to_json() if self.b_v else None,
            "seed": self.seed,
            "folded": self.folded,
            "attention_bias_added": self.attention_bias_added,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> SymmetryBreakingConfig:
        if data.get("type") != CONFIG_TYPE:
            raise ValueError(f"config.{CONFIG_KEY} is not a symmetry-breaking record (type={data.get('type')!r})")
        return cls(
            b_q=BiasDistribution.coerce(data.get("b_q")),
            b_v=BiasDistribution.coerce(data.get("b_v")),
            seed=data.get("seed"),
            folded=bool(data.get("folded", False)),
            attention_bias_added=bool(data.get("attention_bias_added", False)),
            version=data.get("version", __version__),
        )


def get_symmetry_config(config) -> SymmetryBreakingConfig | None:
    """The symmetry-breaking setting recorded in a model config, or None."""
    data = getattr(config, CONFIG_KEY, None)
    return SymmetryBreakingConfig.from_json(data) if data else None


# -- hooks ------------------------------------------------------------------------------------
# Hooks are small callable objects holding the attention module they serve: ``copy.deepcopy``
# of the model then copies them along with their modules.


def _bias(attn: nn.Module, kind: str) -> torch.Tensor:
    """The bias in use: the current draw while training, its mean in evaluation."""
    return getattr(attn, f"sinv_b_{kind}" if attn.training else f"sinv_b_{kind}_mean")


def _add_per_head(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``out`` is ``[..., heads * d]``: add ``bias`` (``[d]``) to every head."""
    return (out.unflatten(-1, (-1, bias.numel())) + bias.to(out.dtype)).flatten(-2)


class _ProjectionHook:
    """Adds ``b_<kind>`` to every head of a projection output (``[..., heads*d]``)."""

    def __init__(self, attn: nn.Module, kind: str):
        self.attn, self.kind = attn, kind

    def __call__(self, module, args, out):
        return _add_per_head(out, _bias(self.attn, self.kind))


class _FusedQKVHook:
    """GPT-2's ``c_attn``: output ``[..., 3*width]`` = query | key | value columns."""

    def __init__(self, attn: nn.Module, kinds: tuple[str, ...]):
        self.attn, self.kinds = attn, kinds

    def __call__(self, module, args, out):
        q, k, v = out.chunk(3, dim=-1)
        if "q" in self.kinds:
            q = _add_per_head(q, _bias(self.attn, "q"))
        if "v" in self.kinds:
            v = _add_per_head(v, _bias(self.attn, "v"))
        return torch.cat([q, k, v], dim=-1)


class _Resampler:
    """Forward pre-hook on the base model: draws new biases for every layer in training mode.

    Drawing once per model forward (not per projection call) keeps the draw fixed while
    gradient checkpointing recomputes a layer in the backward pass.
    """

    def __init__(self, attns: list[nn.Module], setting: SymmetryBreakingConfig):
        self.attns, self.setting = attns, setting
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.setting.seed is None:
            return None
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.setting.seed)
        return self.generators[device]

    @torch.no_grad()
    def resample(self) -> None:
        for attn in self.attns:
            for kind, dist in (("q", self.setting.b_q), ("v", self.setting.b_v)):
                if dist is None:
                    continue
                mean, std = getattr(attn, f"sinv_b_{kind}_mean"), getattr(attn, f"sinv_b_{kind}_std")
                getattr(attn, f"sinv_b_{kind}").copy_(_draw(dist.dist, mean, std, self.generator(mean.device)))

    def __call__(self, module, args):
        if any(attn.training for attn in self.attns):
            self.resample()


def _draw(dist: str, mean: torch.Tensor, std: torch.Tensor, generator) -> torch.Tensor:
    if dist == "constant":
        return mean
    shape, kw = mean.shape, {"generator": generator, "device": mean.device, "dtype": torch.float32}
    # uniform: unit variance, like the normal
    noise = torch.randn(shape, **kw) if dist == "normal" else (torch.rand(shape, **kw) * 2 - 1) * math.sqrt(3.0)
    return (mean.float() + std.float() * noise).to(mean.dtype)


# -- public API -------------------------------------------------------------------------------


class SymmetryBreakingHandle:
    """Returned by :func:`add_symmetry_breaking`; ``remove()`` undoes it exactly."""

    def __init__(self, model: nn.Module, setting: SymmetryBreakingConfig, attns, hooks, resampler):
        self.model, self.setting = model, setting
        self._attns, self._hooks, self._resampler = attns, hooks, resampler

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def mean(self, layer: int, kind: str = "q") -> torch.Tensor | None:
        """``E[b_Q]`` (``kind="q"``) or ``E[b_V]`` of ``layer``, or None where that bias is off."""
        return getattr(self._attns[layer], f"sinv_b_{kind}_mean", None)

    def current(self, layer: int, kind: str = "q") -> torch.Tensor | None:
        """The latest training draw of ``layer``'s bias (the mean before any training forward)."""
        return getattr(self._attns[layer], f"sinv_b_{kind}", None)

    def resample(self) -> None:
        """Draw new biases now (training forwards do this by themselves)."""
        self._resampler.resample()

    def remove(self) -> None:
        """Remove hooks, buffers and the config entry; the model computes exactly what it did before."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for attn in self._attns:
            for kind in ("q", "v"):
                for name in _BUFFERS:
                    attn._buffers.pop(name.format(kind), None)
        if hasattr(self.model.config, CONFIG_KEY):
            delattr(self.model.config, CONFIG_KEY)
        if self.setting.attention_bias_added:
            self.model.config.attention_bias = False
        if self.model.__dict__.get(_HANDLE_ATTR) is self:
            del self.model.__dict__[_HANDLE_ATTR]

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"SymmetryBreakingHandle({state}, b_q={self.setting.b_q}, b_v={self.setting.b_v})"


def get_symmetry_breaking(model: nn.Module) -> SymmetryBreakingHandle | None:
    """The active handle of ``model``, or None."""
    handle = model.__dict__.get(_HANDLE_ATTR)
    return handle if handle is not None and handle.active else None


def add_symmetry_breaking(
    model: nn.Module,
    b_q: BiasDistribution | Mapping | None = DEFAULT_B_Q,
    b_v: BiasDistribution | Mapping | None = DEFAULT_B_V,
    seed: int | None = None,
) -> SymmetryBreakingHandle:
    """Add unlearned, per-forward-resampled query and value biases to every attention layer.

    ``b_q`` / ``b_v``: a :class:`BiasDistribution` (or a mapping of its fields); ``None``
    turns that bias off. ``seed`` makes the training draws reproducible (per device); without
    it they come from torch's global generator. The setting is recorded in
    ``model.config.sinv_symmetry``. Raises ``ValueError`` for an unsupported architecture,
    one with no bias that could carry ``E[b]`` into a checkpoint (Mistral; ``b_Q`` of Qwen3),
    when both biases are off, or when the model already has symmetry breaking.
    """
    setting = SymmetryBreakingConfig(BiasDistribution.coerce(b_q), BiasDistribution.coerce(b_v), seed)
    if setting.b_q is None and setting.b_v is None:
        raise ValueError("b_q and b_v are both None: nothing to add")
    if get_symmetry_breaking(model) is not None:
        raise ValueError("the model already has symmetry breaking; remove() its handle first")
    adapter = get_adapter(model)
    attns = [adapter.attention(layer) for layer in range(adapter.num_layers)]
    kinds = tuple(k for k, d in (("q", setting.b_q), ("v", setting.b_v)) if d is not None)
    # validate everything before changing anything
    folds = [fold_plan(attn, model.config, kinds) for attn in attns]
    for attn in attns:
        clash = [n.format(k) for k in "qv" for n in _BUFFERS if hasattr(attn, n.format(k))]
        if clash:
            raise ValueError(f"{type(attn).__name__} already has attributes {clash}")
    vectors = [
        {kind: getattr(setting, f"b_{kind}").vectors(adapter.layout(layer).head_dim) for kind in kinds}
        for layer in range(len(attns))
    ]  # raises on a head_dim mismatch before anything changes

    hooks = []
    for attn, fold, layer_vectors in zip(attns, folds, vectors, strict=True):
        ref = _reference_tensor(attn)
        hooks.append(attn.register_state_dict_post_hook(FoldOnSave(attn, fold)))
        hooks.append(attn.register_load_state_dict_pre_hook(UnfoldOnLoad(attn, fold)))
        for kind, (mean, std) in layer_vectors.items():
            mean, std = mean.to(ref.device, ref.dtype), std.to(ref.device, ref.dtype)
            attn.register_buffer(f"sinv_b_{kind}", mean.clone(), persistent=False)
            attn.register_buffer(f"sinv_b_{kind}_mean", mean, persistent=False)
            attn.register_buffer(f"sinv_b_{kind}_std", std, persistent=False)
        if fold.targets[0].child == "c_attn":
            hooks.append(attn.c_attn.register_forward_hook(_FusedQKVHook(attn, kinds)))
            continue
        for target in fold.targets:
            hooks.append(getattr(attn, target.child).register_forward_hook(_ProjectionHook(attn, target.kind)))
    if any(fold.needs_attention_bias for fold in folds):
        setting.attention_bias_added = True
        model.config.attention_bias = True  # the saved config builds the biases the folded means sit in
    resampler = _Resampler(attns, setting)
    hooks.append(adapter.base.register_forward_pre_hook(resampler))
    handle = SymmetryBreakingHandle(model, setting, attns, hooks, resampler)
    setattr(model.config, CONFIG_KEY, setting.to_json())
    model.__dict__[_HANDLE_ATTR] = handle
    return handle


def restore_symmetry_breaking(model: nn.Module) -> SymmetryBreakingHandle | None:
    """Re-add the symmetry breaking recorded in ``model.config`` (after loading a checkpoint).

    Returns the handle, the existing one when the model already has it, or None when the
    config records none.
    """
    existing = get_symmetry_breaking(model)
    if existing is not None:
        return existing
    setting = get_symmetry_config(model.config)
    if setting is None:
        return None
    if setting.folded:
        _unfold(model, setting)
    return add_symmetry_breaking(model, b_q=setting.b_q, b_v=setting.b_v, seed=setting.seed)


def _unfold(model: nn.Module, setting: SymmetryBreakingConfig) -> None:
    """Take the folded ``E[b]`` out of a loaded checkpoint's biases (and the biases only folding added)."""
    adapter = get_adapter(model)
    kinds = tuple(k for k, d in (("q", setting.b_q), ("v", setting.b_v)) if d is not None)
    attns = [adapter.attention(layer) for layer in range(adapter.num_layers)]
    for layer, attn in enumerate(attns):
        head_dim, dtype = adapter.layout(layer).head_dim, _reference_tensor(attn).dtype
        # rounded like the buffers that were folded in (add_symmetry_breaking keeps them in the weights' dtype)
        means = {kind: getattr(setting, f"b_{kind}").vectors(head_dim)[0].to(dtype) for kind in kinds}
        unfold_parameters(attn, fold_plan(attn, model.config, kinds).targets, means)
    if setting.attention_bias_added and all(drop_zero_attention_biases(attn, dry_run=True) for attn in attns):
        for attn in attns:
            drop_zero_attention_biases(attn)
        model.config.attention_bias = False


def _reference_tensor(attn: nn.Module) -> torch.Tensor:
    for p in attn.parameters():
        if p.is_floating_point():
            return p
    return torch.empty(0)
