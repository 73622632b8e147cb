"""Checkpoints of pruned models: config bookkeeping, remote code, stock export, loading.

Two reload routes exist for a pruned model:

* **stock**: the same sizes in every layer, which the config can state: the config's
  own ``intermediate_size`` (GPT-2 ``n_inner``) and, for LLaMA-family models,
  ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` describe the pruned
  shapes and the stock class loads them. GPT-2 and BERT qualify while their heads are
  untouched (their configs cannot describe pruned heads).
* **remote code**: everything else; the config keeps the original head and MLP sizes
  (and expert count, where MoE layers keep different ones; one count in every MoE layer is
  stated as kept, since transformers' load-balancing loss sizes its sums with it)
  plus the pruning record, the model's class becomes ``SinvPruned<Base>`` (a subclass
  whose ``__init__`` re-applies the record), and ``save_pretrained`` ships
  ``modeling_sinv_prune.py`` with an ``auto_map`` so ``AutoModel*`` loads it with
  ``trust_remote_code=True``.

On both routes the config's layer count (``num_hidden_layers`` / ``n_layer``) and
``layer_types`` describe the current stack: removed blocks are never rebuilt.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import weakref

import transformers
from torch import nn
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.surgery.keep_tokenizer import remember_tokenizer, tokenizer_source
from sinv_prune.surgery.record import PruningRecord, get_record
from sinv_prune.surgery.unit import units
from sinv_prune.symmetry import restore_symmetry_breaking

logger = logging.getLogger(__name__)

PREFIX = "SinvPruned"
REMOTE_MODULE = "modeling_sinv_prune"
AUTO_MAPPINGS = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForPreTraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}
_CLASSES: dict[tuple[type, str], type] = {}


def base_class(cls: type) -> type:
    """The stock transformers class under a ``SinvPruned*`` class."""
    while getattr(cls, "_sinv_base", None) is not None:
        cls = cls._sinv_base
    return cls


def pruned_class(base: type, module: str = f"sinv_prune.{REMOTE_MODULE}") -> type:
    """``SinvPruned<Base>``: ``base`` whose ``__init__`` rebuilds the recorded pruned shapes."""
    base = base_class(base)
    importlib.import_module(module)  # save_pretrained copies this module's file
    key = (base, module)
    if key not in _CLASSES:

        def __init__(self, config, *args, **kwargs):
            base.__init__(self, config, *args, **kwargs)
            record = get_record(config)
            if record is not None and not record.stock_layout:
                apply_record(self, record)

        _CLASSES[key] = type(
            PREFIX + base.__name__,
            (base,),
            {"__init__": __init__, "__module__": module, "_sinv_base": base, "__doc__": base.__doc__},
        )
        # save_pretrained copies this module's file when the class has an auto class.
        autos = _auto_map(base.config_class.model_type, base.__name__)
        _CLASSES[key]._auto_class = next(
            (a for a, v in autos.items() if v.endswith(PREFIX + base.__name__)), "AutoModel"
        )
    return _CLASSES[key]


def class_by_name(name: str, module: str) -> type:
    """Resolve ``SinvPruned<Base>`` for the remote-code module's ``__getattr__``."""
    if not name.startswith(PREFIX) or not hasattr(transformers, name[len(PREFIX) :]):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    cls = pruned_class(getattr(transformers, name[len(PREFIX) :]), module)
    setattr(sys.modules[module], name, cls)
    return cls


#: The stock-route refusals already logged, per model (weakly: a collected model drops its entry).
_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def finalize_checkpoint_format(model: nn.Module, adapter: HeadAdapter, record: PruningRecord) -> None:
    """Choose the reload route after pruning and set class and config to match it."""
    from sinv_prune.surgery.record import set_record  # looked up at call time (tests inject failures there)

    config = model.config
    base = base_class(type(model))
    layouts = {adapter.layout(i) for i in range(adapter.num_layers)}
    widths = dense_widths(adapter)
    stock_reason = next(
        (why for why in (u.stock_refusal(adapter, record) for u in units()) if why),
        None,
    ) or _stock_refusal(adapter, config, record, layouts, widths)
    for unit in units():
        unit.state_config(model, adapter, record, stock_reason is None)
    if stock_reason is None:
        (layout,) = layouts
        if _heads_pruned(record):
            set_head_counts(adapter, config, layout.num_heads, layout.num_kv_heads, record.head_dim)
        for width in widths:  # none in a model whose every layer is MoE
            _set_intermediate(adapter, config, width)
        record.stock_layout = True
        model.__class__ = base
        config.architectures = [base.__name__]
        if getattr(config, "auto_map", None):
            kept = {k: v for k, v in config.auto_map.items() if REMOTE_MODULE not in str(v)}
            if kept:
                config.auto_map = kept
            else:  # saved as null, auto_map would break AutoConfig; drop the attribute
                vars(config).pop("auto_map", None)
    else:
        if getattr(adapter, "stock_reload", False) and stock_reason not in _WARNED.setdefault(model, set()):
            _WARNED[model].add(stock_reason)  # once per model and reason, not at every prune of it
            logger.warning("sinv_prune: %s; the checkpoint reloads through trust_remote_code=True", stock_reason)
        set_head_counts(adapter, config, record.num_heads, record.num_kv_heads, record.head_dim)
        _set_intermediate(adapter, config, record.intermediate_size)
        record.stock_layout = False
        model.__class__ = pruned_class(base)
        config.auto_map = _auto_map(config.model_type, base.__name__)
    set_record(config, record)


def _heads_pruned(record: PruningRecord) -> bool:
    return any(record.pruned_heads.values())


def _stock_refusal(adapter, config, record, layouts, widths) -> str | None:
    """Why the stock class cannot load this pruned model, or None when it can."""
    heads = _heads_pruned(record)
    if heads and not getattr(adapter, "stock_reload", False):
        return "stock classes cannot describe pruned heads for this architecture"
    if len(layouts) != 1:
        return "layers keep different head counts, which stock classes cannot describe"
    if len(widths) > 1:
        return "layers keep different MLP widths, which stock classes cannot describe"
    (layout,) = layouts
    if layout.num_heads == 0:
        return "every layer lost all its heads"
    trial = config.to_dict()
    if heads:
        trial.update({adapter.config_heads_key: layout.num_heads, "head_dim": record.head_dim})
        trial[adapter.config_kv_heads_key] = layout.num_kv_heads
    for width in widths:
        trial[adapter.config_intermediate_key] = width
    try:
        type(config).from_dict(trial)
    except Exception as err:  # the config class's own validation decides
        what = f"{layout.num_heads} heads" if heads else f"MLP width {trial[adapter.config_intermediate_key]}"
        return f"{type(config).__name__} refuses {what} ({err})"
    return None


def dense_widths(adapter: HeadAdapter) -> set[int]:
    """The MLP widths of the dense layers (a mixture-of-experts layer has none)."""
    return {adapter.intermediate_size(i) for i in range(adapter.num_layers) if not adapter.num_experts(i)}


def expert_widths(adapter: HeadAdapter) -> tuple[set[int], set[int]]:
    """The routed-expert widths and the shared-expert widths over the MoE layers."""
    moe = [i for i in range(adapter.num_layers) if adapter.num_experts(i)]
    return {adapter.expert_width(i) for i in moe}, {adapter.shared_width(i) for i in moe if adapter.shared_width(i)}


def _set_intermediate(adapter, config, width: int | None) -> None:
    """State the MLP width in the config, leaving it alone when it already says so (GPT-2's None = 4 x n_embd)."""
    if width is not None and adapter.config_intermediate_size(config) != width:
        setattr(config, adapter.config_intermediate_key, width)


def set_head_counts(adapter, config, heads: int, kv_heads: int, head_dim: int) -> None:
    setattr(config, adapter.config_heads_key, heads)
    if adapter.config_kv_heads_key:
        setattr(config, adapter.config_kv_heads_key, kv_heads)
        config.head_dim = head_dim


def _auto_map(model_type: str, class_name: str) -> dict[str, str]:
    """``auto_map`` entries for every Auto class that serves ``model_type``."""
    out = {}
    for auto, mapping_name in AUTO_MAPPINGS.items():
        name = getattr(modeling_auto, mapping_name, {}).get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name and hasattr(transformers, name):
            out[auto] = f"{REMOTE_MODULE}.{PREFIX}{name}"
    out.setdefault("AutoModel", f"{REMOTE_MODULE}.{PREFIX}{class_name}")
    return out


def from_pretrained(
    path_or_repo_id: str | os.PathLike,
    *,
    model_cls: type | None = None,
    offload: str = "none",
    offload_folder: str | os.PathLike | None = None,
    offload_device: str | None = None,
    **kwargs,
) -> nn.Module:
    """Load a pruned (or plain) checkpoint into the right class, with no remote code needed.

    ``gguf_file=`` loads a GGUF checkpoint as an ordinary float model that trains and
    saves (transformers alone marks it quantized). A path ending in ``.gguf`` works too.

    ``offload="cpu"`` / ``"disk"`` loads the transformer blocks into host RAM / an offload folder
    (``offload_folder``; safetensors checkpoints are read in place) behind accelerate's hooks and the
    rest onto ``offload_device`` (default: the first GPU, else the CPU), through a ``device_map``
    (:mod:`sinv_prune.surgery.offload`): the model is never whole on the device, and with disk
    never whole in host RAM. Not with ``device_map=`` (give one or the other; with a ``device_map``,
    ``offload_folder`` is transformers' own).
    """
    from sinv_prune.surgery.offload import check_offload, offload_load_kwargs

    if offload == "none" and offload_folder is not None:  # transformers' own, for a device_map with "disk"
        kwargs["offload_folder"], offload_folder = offload_folder, None
    check_offload(offload, offload_folder)
    if offload != "none" and kwargs.get("device_map") is not None:
        raise ValueError(f"offload={offload!r} places the model itself; do not also give device_map")
    path = os.fspath(path_or_repo_id)
    if path.endswith(".gguf") and os.path.isfile(path):
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    config_kwargs = {k: kwargs[k] for k in ("gguf_file", "revision", "token", "cache_dir", "subfolder") if k in kwargs}
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path, **config_kwargs)
    record = get_record(config)
    cls = model_cls or model_class(config, record, gguf=bool(kwargs.get("gguf_file")))
    if record is not None and not record.stock_layout:
        cls = pruned_class(cls)
    kwargs.update(offload_load_kwargs(cls, config, offload, offload_device, offload_folder))
    with _gguf_bar_follows_transformers() if kwargs.get("gguf_file") else contextlib.nullcontext():
        model = cls.from_pretrained(path, config=config, **kwargs)
    if kwargs.get("gguf_file"):
        _drop_gguf_quantizer(model)
        source = os.path.join(path, kwargs["gguf_file"])
        if os.path.isfile(source):  # export_gguf copies the tokenizer keys from here
            model.sinv_gguf_source = os.path.abspath(source)
    restore_symmetry_breaking(model)  # eval after reload matches training-time biases
    remember_tokenizer(model, tokenizer_source(path, **kwargs))
    return model


@contextlib.contextmanager
def _gguf_bar_follows_transformers():
    """transformers' GGUF conversion bar uses plain ``tqdm`` and ignores its own
    ``disable_progress_bar()``; make it follow that setting (a quiet run's log stays quiet)."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def model_class(config, record: PruningRecord | None, gguf: bool = False) -> type:
    """The stock transformers class a checkpoint's config names (Auto class as a fallback)."""
    names = [record.base_class] if record else []
    names += [a[len(PREFIX) :] if a.startswith(PREFIX) else a for a in (config.architectures or [])]
    for name in names:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    if gguf or config.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _drop_gguf_quantizer(model: nn.Module) -> None:
    """Turn a dequantized GGUF load into a plain model that saves and fine-tunes."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    odd = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if odd:
        raise ValueError(f"GGUF weights are still quantized ({odd[0]}, ...); cannot make a trainable model")
    quantizer.remove_quantization_config(model)
    model.hf_quantizer = None  # transformers deletes the attribute; callers expect None


def apply_record(model: nn.Module, record: PruningRecord) -> None:
    """Slice a freshly built model (original head and MLP sizes, current layer count) to ``record``'s shapes."""
    adapter = get_adapter(model)
    kept_layers = record.kept_layers()
    if adapter.num_layers != len(kept_layers):
        raise ValueError(
            f"the config builds {adapter.num_layers} layers but the pruning record keeps {len(kept_layers)} "
            f"of {record.num_layers}"
        )
    for current, original in enumerate(kept_layers):
        for unit in units():
            unit.rebuild(adapter, current, original, record)
    for unit in units():  # what the forward reads beyond the shapes (the load-balancing loss's expert count)
        unit.state_config(model, adapter, record, False)
