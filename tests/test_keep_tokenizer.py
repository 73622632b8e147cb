"""A model loaded with ``sinv_prune.from_pretrained`` saves its tokenizer with itself (the README's path)."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from conftest import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import sinv_prune
from sinv_prune.surgery.keep_tokenizer import has_tokenizer


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(60)} | {"[UNK]": 60}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")


def test_a_pruned_copy_saves_itself_and_the_tokenizer_it_was_loaded_with(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "src")
    word_tokenizer().save_pretrained(tmp_path / "src")
    model = sinv_prune.from_pretrained(tmp_path / "src")
    twin = copy.deepcopy(model)
    sinv_prune.prune(twin, {"mlp": {0: [0, 1, 2]}})
    twin.save_pretrained(tmp_path / "out")
    assert has_tokenizer(tmp_path / "out")
    again = sinv_prune.from_pretrained(tmp_path / "out")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # the copy's weights were saved, not the original's
        torch.testing.assert_close(again(input_ids=ids).logits, twin(input_ids=ids).logits, rtol=0, atol=0)
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path / "out")
    assert loaded("w3 w7")["input_ids"] == [3, 7]


def test_a_pickled_model_still_saves_itself_with_its_tokenizer(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "src")
    word_tokenizer().save_pretrained(tmp_path / "src")
    torch.save(sinv_prune.from_pretrained(tmp_path / "src"), tmp_path / "model.pt")
    model = torch.load(tmp_path / "model.pt", weights_only=False)
    model.save_pretrained(tmp_path / "out")
    assert has_tokenizer(tmp_path / "out") and (tmp_path / "out" / "config.json").is_file()


def test_no_tokenizer_where_the_source_had_none_and_no_reference_cycle(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "src")
    model = sinv_prune.from_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "out")
    assert not has_tokenizer(tmp_path / "out")
    word_tokenizer().save_pretrained(tmp_path / "src")
    model = sinv_prune.from_pretrained(tmp_path / "src")
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model  # freed by reference counting alone: the saving hook holds the model weakly
        assert gone() is None
    finally:
        gc.enable()
