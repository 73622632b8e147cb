"""finetune.data.generate: the base model writes the fine-tune's blocks from prompts of the train split."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner

from sinv_prune.cli import main
from sinv_prune.pipeline.recipe import GeneratedText
from sinv_prune.pipeline.teacher_text import generated_blocks, prompt_starts, sample_continuations
from tests.test_recovery_finetune import tiny_recipe

VOCAB = 96


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_prompt_starts_spread_evenly_and_refuse_short_text():
    assert prompt_starts(100, 4, 5) == [0, 24, 48, 72, 96]
    assert prompt_starts(10, 4, 1) == [0]
    with pytest.raises(ValueError, match="fewer than prompt_tokens"):
        prompt_starts(3, 4, 2)


def test_near_zero_temperature_is_the_greedy_continuation_without_eos(tmp_path):
    """Blocks = the prompt at its start, then the argmax of a full forward each step, EOS never chosen."""
    model = tiny_llama()
    ids = torch.arange(200) % VOCAB
    spec = GeneratedText(prompt_tokens=4, temperature=1e-6, batch_size=2)
    path = generated_blocks(model, ids, spec, 12, 5, tmp_path, eos_token_id=1)
    blocks = np.load(path)
    assert blocks.shape == (5, 12) and json.loads((path.parent / "meta.json").read_text())["blocks"] == 5
    for block, start in zip(blocks, [0, 49, 98, 147, 196], strict=True):
        expected = ids[start : start + 4].tolist()
        with torch.no_grad():
            while len(expected) < 12:  # no KV cache: the whole sequence each step
                logits = model(torch.tensor([expected])).logits[0, -1]
                logits[1] = float("-inf")  # EOS is held back until the block is full
                expected.append(int(logits.argmax()))
        assert block.tolist() == expected


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampling_draws_from_the_whole_tempered_distribution(temperature):
    """The first new token's frequencies over 20,000 draws match softmax(logits / T) over all 96 tokens
    (generate's default top-k 50 would leave out the tail; its total variation would be far above 0.05)."""
    model = tiny_llama()
    prompt = torch.tensor([[5, 17, 33, 2]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    logits[1] = float("-inf")
    probs = torch.softmax(logits / temperature, -1)
    spec = GeneratedText(prompt_tokens=4, temperature=temperature)
    torch.manual_seed(1)
    draws = torch.cat([sample_continuations(model, prompt.repeat(2000, 1), 5, spec, eos_token_id=1)[:, -1]
                       for _ in range(10)])  # fmt: skip
    freq = torch.bincount(draws, minlength=VOCAB).double() / len(draws)
    assert freq[1] == 0 and 0.5 * (freq - probs.double()).abs().sum() < 0.05
    tail = probs.sort(descending=True).values[50:].sum()
    assert tail > 0.2  # the test can tell a top-50 cut from the whole distribution


def test_blocks_are_reproducible_seeded_and_reused_by_their_key(tmp_path, monkeypatch):
    from sinv_prune.pipeline import teacher_text

    model = tiny_llama()
    ids = torch.arange(300) % VOCAB
    spec = GeneratedText(prompt_tokens=3, batch_size=4)
    a = np.load(generated_blocks(model, ids, spec, 10, 6, tmp_path / "a", seed=0))
    b = np.load(generated_blocks(model, ids, spec, 10, 6, tmp_path / "b", seed=0))
    c = np.load(generated_blocks(model, ids, spec, 10, 6, tmp_path / "c", seed=1))
    assert (a == b).all() and (a[:, 3:] != c[:, 3:]).any() and (a[:, :3] == c[:, :3]).all()
    state = torch.random.get_rng_state()
    monkeypatch.setattr(teacher_text, "sample_continuations", lambda *a, **k: pytest.fail("written again"))
    again = generated_blocks(model, ids, spec, 10, 6, tmp_path / "a", seed=0)
    assert (np.load(again) == a).all() and torch.equal(torch.random.get_rng_state(), state)
    with pytest.raises(ValueError, match=r"prompt_tokens \(10\) must be below seq_len"):
        generated_blocks(model, ids, GeneratedText(prompt_tokens=10), 10, 2, tmp_path / "d")


def test_a_recipe_distils_on_text_its_base_model_writes(tmp_path):
    recipe = tiny_recipe(tmp_path)
    recipe["prune"]["arms"] = [{"criterion": "magnitude", "amount": 2}, {"control": True}]
    recipe["finetune"] = {**recipe["finetune"], "data": {"generate": {"prompt_tokens": 8, "batch_size": 8}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    dry = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert dry.exit_code == 0 and "base model writes 32 blocks of 24 new tokens" in dry.output, dry.output
    result = CliRunner().invoke(main, ["run", str(path), "--output", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    (written,) = (out / "finetune_data").iterdir()
    blocks = np.load(written / "blocks.npy")
    assert blocks.shape == (32, 32)  # ceil(1000 / (4 x 32)) = 8 steps of 4 blocks
    import sinv_prune
    from sinv_prune import data as data_mod

    tokenizer = data_mod.load_model_tokenizer(str(out / "tokenizer"))
    train = data_mod.synthetic_corpus(**{**{"seed": 0}, **recipe["data"]["synthetic"]})["train"]["text"]
    ids = data_mod.token_ids(train, tokenizer)
    starts = prompt_starts(len(ids), 8, 32)
    assert all(blocks[i, :8].tolist() == ids[s : s + 8].tolist() for i, s in enumerate(starts))
    # the text is the base model's own: its loss on it is below its loss on shuffled text
    base = sinv_prune.from_pretrained(out / "base").eval()
    tensor = torch.as_tensor(blocks, dtype=torch.long)
    with torch.no_grad():
        own = base(tensor, labels=tensor).loss
        shuffled = tensor[:, torch.randperm(32, generator=torch.Generator().manual_seed(0))]
        other = base(shuffled, labels=shuffled).loss
    assert own < other
    results = json.loads((out / "results.json").read_text())
    assert all(arm["finetune_tokens"] == 1024 for arm in results["arms"])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"finetune": {"tokens": 100, "data": {"generate": {"prompt_tokens": 32}}}},
         "error: finetune.data.generate.prompt_tokens (32) must be below data.seq_len (32)"),
        ({"finetune": {"data": {"generate": {}}}}, "a streamed or generated source has no length"),
        ({"finetune": {"tokens": 100, "data": {"generate": {"top_p": 1.5}}}}, "finetune.data.generate.top_p"),
        ({"model": {"architecture": "bert", "config": {"num_hidden_layers": 2, "num_attention_heads": 4,
                                                       "hidden_size": 32, "intermediate_size": 48}},
          "finetune": {"tokens": 100, "data": {"generate": {}}}},
         "error: finetune.data.generate: a masked LM writes no text; give files or hub"),
    ],
)  # fmt: skip
def test_bad_generate_settings_are_one_line_usage_errors(tmp_path, change, message):
    recipe = {**tiny_recipe(tmp_path), **change}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(main, ["run", str(path), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
