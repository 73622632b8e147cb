"""SentencePiece vocabularies in GGUF: a LLaMA-2 style tokenizer.model tokenizes in llama.cpp as in transformers."""

from __future__ import annotations

import io
import types

import gguf
import pytest
import torch
import transformers
from conftest import TINY_CONFIGS, wikitext

import sinv_prune

N_VOCAB = 1024  # the embedding is larger than the tokenizer: ids past it are padding
SPECIAL = "<|turn|>"


def lines(split: str, count: int) -> list[str]:
    """Non-empty, non-heading WikiText-2 lines (skips when WikiText-2 is absent)."""
    rows = [r.strip() for r in wikitext(split).splitlines()]
    return [r for r in rows if r and not r.startswith("=")][:count]


def train_spm(path, model_type: str = "bpe", vocab_size: int = 1000, **options) -> None:
    """A tiny SentencePiece model with LLaMA-2's options (byte fallback, split digits, no normaliser)."""
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    settings = dict(byte_fallback=True, split_digits=True, normalization_rule_name="identity",
                    remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, add_dummy_prefix=True,
                    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=0.9995, minloglevel=2)  # fmt: skip
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines("valid", 2000)), model_writer=buf,
                                   vocab_size=vocab_size, model_type=model_type, **{**settings, **options})  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(buf.getvalue())


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    pytest.importorskip("google.protobuf")
    folder = tmp_path_factory.mktemp("spm")
    train_spm(folder)
    tokenizer = transformers.LlamaTokenizer.from_pretrained(folder, add_bos_token=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [SPECIAL]})
    return tokenizer


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=N_VOCAB, bos_token_id=1, eos_token_id=2, **TINY_CONFIGS["llama"][2])
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_sentencepiece_vocab_keys(llama_tokenizer, tmp_path):
    out = sinv_prune.export_gguf(tiny_llama(), llama_tokenizer, tmp_path / "m.gguf", type="f32", verify=False)
    assert "SentencePiece BPE, 1000 pieces" in out.tokenizer
    meta = {k: f.contents() for k, f in gguf.GGUFReader(out.path).fields.items()}
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.pre"] == "default"
    tokens, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(meta["tokenizer.ggml.scores"]) == len(kinds) == N_VOCAB
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3] == "<0x00>" and tokens[1000] == SPECIAL
    assert kinds.count(gguf.TokenType.BYTE) == 256 and kinds[1000] == gguf.TokenType.CONTROL
    assert tokens[1001:] == [f"[PAD{i}]" for i in range(1001, N_VOCAB)]
    assert set(kinds[1001:]) == {gguf.TokenType.UNUSED}
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_space_prefix"] is True


def test_llama_cpp_tokenizes_as_transformers(llama_tokenizer, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    out = sinv_prune.export_gguf(tiny_llama(), llama_tokenizer, tmp_path / "m.gguf", type="f32", verify=False)
    llm = llama_cpp.Llama(str(out.path), vocab_only=True, verbose=False)
    try:
        sentences = lines("test", 50)
        assert len(sentences) == 50
        for text in sentences:  # WikiText's "<unk>" is text here, as in SentencePiece itself
            hf = llama_tokenizer.encode(text, split_special_tokens=True)
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf, text
        # Special tokens read from text; llama.cpp adds a space prefix after one, so none is followed by text here.
        text = f"Digits 2026, two  spaces,\ttabs\n{SPECIAL}"
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == llama_tokenizer.encode(text)
        assert llama_tokenizer.encode(text)[-1] == 1000
    finally:
        llm.close()


def test_unigram_model_is_refused_and_nothing_written(tmp_path):
    pytest.importorskip("google.protobuf")
    train_spm(tmp_path / "uni", model_type="unigram", vocab_size=600)
    tokenizer = types.SimpleNamespace(vocab_file=str(tmp_path / "uni" / "tokenizer.model"), added_tokens_decoder={})
    with pytest.raises(ValueError, match=r"^cannot export the tokenizer: a SentencePiece UNIGRAM model") as err:
        sinv_prune.export_gguf(tiny_llama(), tokenizer, tmp_path / "m.gguf", type="f32", verify=False)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["uni"]
