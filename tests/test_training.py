"""The recipe's train / fine-tune stages: every optimizer runs Trainer steps (with and without symmetry breaking),
its defaults and ``optimizer_args`` reach it, and ECD warns when ``F0`` stops it."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import VOCAB, tiny_model
from transformers import PreTrainedTokenizerFast, TrainerCallback

from sinv_prune.cli import main
from sinv_prune.data import lm_blocks
from sinv_prune.pipeline.recipe import (
    FINETUNE_RECIPE_DEFAULTS,
    RecipeError,
    load_recipe,
    recipe_to_yaml,
    validate_recipe,
)
from sinv_prune.pipeline.training import run_trainer
from sinv_prune.symmetry import ECD, build_optimizer, get_symmetry_breaking


def word_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w1", eos_token="w2")


RECIPE = {
    "model": {"architecture": "gpt2", "config": {"n_layer": 2}},
    "data": {"synthetic": {}, "tokenizer": {"kind": "word"}},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 1}]},
}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "ecd", "soap"])
@pytest.mark.parametrize("symmetry", [False, True])
def test_optimizer_runs_trainer_steps(tmp_path, optimizer, symmetry):
    model = tiny_model("gpt2").train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = {
        "max_steps": 3,
        "batch_size": 4,
        "learning_rate": 0.01 if optimizer != "ecd" else 0.5,
        "optimizer": optimizer,
        "optimizer_args": {"F0": 0.0} if optimizer == "ecd" else {},
        "save_every": 100,
    }
    if symmetry:
        train["symmetry_breaking"] = {}
    recipe = validate_recipe({**RECIPE, "train": train, "finetune": train})
    spec = recipe.train
    assert recipe.finetune.optimizer == optimizer
    ids = torch.randint(3, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    out = run_trainer(
        model, word_tokenizer(), lm_blocks(ids, 16), None, spec, tmp_path,
        mlm=False, seed=0, device="cpu", quiet=True,
    )  # fmt: skip
    assert out.global_step == 3 and torch.isfinite(torch.tensor(out.training_loss))
    moved = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert moved, "no parameter changed"
    assert (get_symmetry_breaking(model) is not None) == symmetry
    assert hasattr(model.config, "sinv_symmetry") == symmetry


# -- per-optimizer defaults, optimizer_args, the ECD F0 warning ---------------------------------


def train_recipe(**train):
    return validate_recipe({**RECIPE, "train": train, "finetune": train})


@pytest.mark.parametrize(
    ("optimizer", "lr", "schedule", "args"),
    [
        ("adamw", 1e-3, "cosine", {}),
        ("sgd", 1e-2, "cosine", {"momentum": 0.9}),
        ("ecd", 1.0, "constant", {"eta": 100.0, "F0": 2.0, "nu": 0.0}),
        ("soap", 3e-3, "cosine", {}),
    ],
)
def test_recipe_resolves_each_optimizers_defaults(optimizer, lr, schedule, args):
    recipe = train_recipe(optimizer=optimizer, max_steps=2)
    assert (recipe.train.learning_rate, recipe.train.lr_scheduler, recipe.train.optimizer_args) == (lr, schedule, args)
    # finetune: the same, but a pretrained model's fine-tune warms up (and AdamW's rate and eps are its own)
    own = FINETUNE_RECIPE_DEFAULTS[optimizer]
    spec = recipe.finetune
    fine_args = {"eps": 1e-6} if optimizer == "adamw" else args
    assert (spec.learning_rate, spec.lr_scheduler, spec.optimizer_args) == (own["learning_rate"], schedule, fine_args)
    assert spec.warmup_ratio == own.get("warmup_ratio", 0.0) and recipe.train.warmup_ratio == 0.0
    resolved = yaml.safe_load(recipe_to_yaml(recipe))["train"]
    assert (resolved["learning_rate"], resolved["lr_scheduler"]) == (lr, schedule)
    assert resolved.get("optimizer_args", {}) == args
    # the recipe's defaults are the optimizer's own: build_optimizer with no arguments gives the same
    built = build_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(3))])
    assert built.defaults["lr"] == lr
    assert {k: built.defaults[k] for k in args} == args


def test_values_the_recipe_sets_win_over_the_optimizers_defaults(tmp_path):
    spec = train_recipe(optimizer="ecd", learning_rate=0.5, lr_scheduler="linear", optimizer_args={"F0": 0.0}).train
    assert (spec.learning_rate, spec.lr_scheduler) == (0.5, "linear")
    assert spec.optimizer_args == {"eta": 100.0, "F0": 0.0, "nu": 0.0}
    assert train_recipe(optimizer="adamw", learning_rate=None).train.learning_rate == 1e-3  # null: the default
    # an override that switches the optimizer brings that optimizer's defaults
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "train": {"max_steps": 2}}))
    spec = load_recipe(path, ["train.optimizer=ecd"]).train
    assert (spec.learning_rate, spec.lr_scheduler, spec.optimizer_args["F0"]) == (1.0, "constant", 2.0)


def test_dry_run_prints_the_resolved_optimizer_settings(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "train": {"optimizer": "ecd", "max_steps": 2}}))
    result = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert (
        "train: ecd, learning_rate 1, lr_scheduler constant, optimizer_args {'eta': 100.0, 'F0': 2.0" in result.output
    )
    assert "in order" not in result.output  # shuffled: the default says nothing
    # the fine-tune's own AdamW defaults, and blocks read in order when the recipe asks
    path.write_text(
        yaml.safe_dump({**RECIPE, "train": {"max_steps": 2}, "finetune": {"max_steps": 2, "shuffle": False}})
    )
    result = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert ("finetune: adamw, learning_rate 5e-05, lr_scheduler cosine, warmup_ratio 0.1, optimizer_args "
            "{'eps': 1e-06}, blocks in order (shuffle: false)") in result.output  # fmt: skip


def test_unknown_or_misplaced_optimizer_args_are_one_line_errors():
    with pytest.raises(RecipeError, match=r"^train\.optimizer_args: unknown argument 'betaz' for optimizer 'adamw'"):
        train_recipe(optimizer_args={"betaz": [0.9, 0.9]})
    with pytest.raises(RecipeError, match="unknown argument 'momentum' for optimizer 'ecd'"):
        train_recipe(optimizer="ecd", optimizer_args={"momentum": 0.9})
    with pytest.raises(RecipeError, match="'lr' is not an optimizer argument here: set learning_rate"):
        train_recipe(optimizer_args={"lr": 0.1})
    with pytest.raises(ValueError, match="unknown argument 'betaz'"):
        build_optimizer("adamw", [torch.nn.Parameter(torch.zeros(3))], betaz=(0.9, 0.9))


class KeepOptimizer(TrainerCallback):
    """Keeps the optimizer the Trainer built (unwrapped from accelerate's wrapper)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)


def train_tiny(tmp_path, steps=3, callbacks=(), **train):
    model = tiny_model("gpt2").train()
    spec = train_recipe(max_steps=steps, batch_size=4, save_every=100, **train).train
    ids = torch.randint(3, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    run_trainer(
        model, word_tokenizer(), lm_blocks(ids, 16), None, spec, tmp_path,
        mlm=False, seed=0, device="cpu", quiet=True, callbacks=list(callbacks),
    )  # fmt: skip
    return model


@pytest.mark.parametrize(
    ("optimizer", "args", "cls"),
    [
        ("adamw", {"betas": [0.8, 0.95], "eps": 1e-6, "amsgrad": True}, torch.optim.AdamW),
        ("sgd", {"momentum": 0.5, "nesterov": True, "dampening": 0.0}, torch.optim.SGD),
        ("ecd", {"F0": 0.0, "eta": 50.0}, ECD),
        ("soap", {"precondition_frequency": 3, "betas": [0.9, 0.9]}, None),
    ],
)
def test_optimizer_args_reach_the_optimizer_the_trainer_builds(tmp_path, optimizer, args, cls):
    keep = KeepOptimizer()
    train_tiny(tmp_path, steps=1, callbacks=[keep], optimizer=optimizer, learning_rate=0.02, optimizer_args=args)
    built = keep.optimizer
    assert cls is None or type(built) is cls
    assert built.defaults["lr"] == 0.02
    for group in built.param_groups:  # decay and no-decay groups alike
        for key, value in args.items():
            assert group[key] == (tuple(value) if isinstance(value, list) else value), key


def test_ecd_warns_once_when_F0_is_at_or_above_the_loss(tmp_path, caplog):  # noqa: N802
    # the pipeline's run.log handler sits on the "sinv_prune" logger: the warning must reach it
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("sinv_prune").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING):
            model = train_tiny(tmp_path / "high", optimizer="ecd", optimizer_args={"F0": 100.0})
        start = tiny_model("gpt2")
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters(), strict=True))
        warned = [r for r in caplog.records if "ECD did not move" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert (
            "F0 + eps = 100 + 1e-10" in warned[0].getMessage() and "optimizer_args: {F0: ...}" in warned[0].getMessage()
        )
        assert [r for r in seen if "ECD did not move" in r.getMessage()] == warned

        caplog.clear()
        with caplog.at_level(logging.WARNING):
            train_tiny(tmp_path / "low", optimizer="ecd", optimizer_args={"F0": 0.0})
        assert not [r for r in caplog.records if "ECD did not move" in r.getMessage()]
    finally:
        logging.getLogger("sinv_prune").removeHandler(handler)
