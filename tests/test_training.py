"""Every optimizer of the recipe's train / fine-tune stages runs Trainer steps, with and without symmetry breaking."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model
from transformers import PreTrainedTokenizerFast

from sinv_prune.data import lm_blocks
from sinv_prune.recipe import validate_recipe
from sinv_prune.symmetry import get_symmetry_breaking
from sinv_prune.training import run_trainer


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
