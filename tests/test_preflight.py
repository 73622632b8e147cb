"""The recipe's preflight (``sinv_prune/pipeline/preflight.py``): what a run refuses before its first stage."""

from __future__ import annotations

import pytest
import transformers
import yaml
from click.testing import CliRunner
from conftest import TINY_CONFIGS, tiny_model

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.deploy.errors import ExportRefused
from sinv_prune.pipeline.preflight import preflight
from sinv_prune.pipeline.recipe import validate_recipe


def word_level_tokenizer(size: int):
    """A word-level tokenizer: not byte-level BPE, so llama.cpp cannot reproduce it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]")


def export_recipe(model_dir, **gguf) -> dict:
    """Train, prune, evaluate and export the model at ``model_dir`` (its own tokenizer)."""
    return {
        "name": "export-preflight",
        "model": {"path": str(model_dir)},
        "data": {"synthetic": {"seed": 0, "num_train": 40, "num_valid": 10, "num_test": 10}, "seq_len": 16},
        "train": {"max_steps": 2, "batch_size": 4},
        "score": {"batches": 1, "batch_size": 4},
        "prune": {"arms": [{"criterion": "magnitude", "amount": 2}]},
        "evaluate": {"speed": False, "prompts": []},
        "export": {"gguf": {"type": "f32", "verify": False, **gguf}},
    }


def test_a_vocabulary_the_export_cannot_write_is_refused_before_training(tmp_path):
    """The export's own refusal, one line and exit 2, before the run directory exists (nothing trained)."""
    model, tokenizer = tiny_model("llama"), word_level_tokenizer(64)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(export_recipe(tmp_path / "model")))
    out = tmp_path / "out"

    result = CliRunner().invoke(main, [str(recipe), "--output", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: export.gguf: cannot export the tokenizer: "), lines
    assert not out.exists()  # refused before the first stage: no run directory, no training
    with pytest.raises(ExportRefused) as refused:  # what the export would have said after the whole run
        sinv_prune.export_gguf(model, tokenizer, tmp_path / "m.gguf", type="f32", verify=False)
    assert lines[0] == f"error: export.gguf: {refused.value}"
    assert not (tmp_path / "m.gguf").exists()
    preflight(validate_recipe(export_recipe(tmp_path / "model", vocab=False)))  # token ids only: nothing to refuse


@pytest.mark.real
@pytest.mark.slow
def test_a_vocabulary_llama_cpp_knows_passes_and_one_larger_than_the_model_does_not(tmp_path):
    """SmolLM2's tokenizer (byte-level BPE, pre-tokenizer 'smollm') with models that embed all of it, or not."""
    from conftest import smollm2_gguf

    from sinv_prune.data import load_model_tokenizer
    from sinv_prune.pipeline.recipe import RecipeError

    tokenizer = load_model_tokenizer(smollm2_gguf())
    for name, vocab in (("fits", len(tokenizer)), ("small", 1000)):
        config = transformers.LlamaConfig(**{**TINY_CONFIGS["llama"][2], "vocab_size": vocab})
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    preflight(validate_recipe(export_recipe(tmp_path / "fits")))
    with pytest.raises(RecipeError, match=r"^export.gguf: cannot export the tokenizer: ids up to \d+, the model "
                                          r"embeds only 1000$"):  # fmt: skip
        preflight(validate_recipe(export_recipe(tmp_path / "small")))
