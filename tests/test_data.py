"""Corpora, text loading, tokenizers, token streams and training blocks (sinv_prune.data)."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
import transformers
from conftest import WIKITEXT, wikitext

from sinv_prune import data


@pytest.fixture(scope="module")
def corpus() -> datasets.DatasetDict:
    return data.synthetic_corpus(num_train=400, num_valid=40, num_test=40, seed=0)


@pytest.fixture(scope="module")
def word_tokenizer(corpus):
    return data.train_tokenizer(corpus["train"], "word")


# -- synthetic corpus --------------------------------------------------------------------------


def test_synthetic_corpus_is_deterministic_per_seed(corpus):
    again = data.synthetic_corpus(num_train=400, num_valid=40, num_test=40, seed=0)
    other = data.synthetic_corpus(num_train=400, num_valid=40, num_test=40, seed=1)
    assert list(corpus) == ["train", "valid", "test"]
    assert {split: len(corpus[split]) for split in corpus} == {"train": 400, "valid": 40, "test": 40}
    for split in corpus:
        assert corpus[split].column_names == ["text"]
        assert corpus[split]["text"][:] == again[split]["text"][:]
        assert corpus[split]["text"][:] != other[split]["text"][:]
    assert corpus["train"]["text"][:40] != corpus["valid"]["text"][:]  # splits are different draws


def test_synthetic_corpus_has_its_structure(corpus):
    vocab = data.synthetic_vocabulary()
    words = [w for group in vocab.values() for w in group]
    assert len(words) == len(set(words)) and 300 <= len(words) <= 600
    number_of = {w: n for n in ("sg", "pl") for key in ("noun", "verb") for w in vocab[f"{key}_{n}"]}
    known = set(words)
    for line in corpus["train"]["text"][:] + corpus["test"]["text"][:]:
        tokens = line.split()
        assert set(tokens) <= known
        # agreement: determiner, noun and every verb share one number
        number = "sg" if tokens[0] == data.DETERMINERS["sg"] else "pl"
        assert tokens[0] == data.DETERMINERS[number] and number_of[tokens[1]] == number
        verbs = [t for t in tokens[2:] if t in number_of]
        assert 2 <= len(verbs) <= 3 and {number_of[v] for v in verbs} == {number}
        # copying: the names after "sa" come back, in order, after "ditto" at the end
        assert tokens.count(data.SPAN_MARK) == 1 and tokens.count(data.COPY_MARK) == 1
        copied = tokens[tokens.index(data.COPY_MARK) + 1 : -1]
        first = tokens[tokens.index(data.SPAN_MARK) + 1 :][: len(copied)]
        assert 3 <= len(copied) <= 6 and first == copied and set(copied) <= set(vocab["name"])
        assert tokens[-1] == data.END_MARK
    # the Markov chain (one walk a line, continued across verbs and spans): <= 4 successors a filler
    fillers, successors = set(vocab["filler"]), {}
    for line in corpus["train"]["text"][:]:
        chain = [t for t in line.split() if t in fillers]
        for a, b in zip(chain, chain[1:], strict=False):
            successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4


def test_synthetic_corpus_options():
    corpus = data.synthetic_corpus(20, 1, 1, seed=3, copies=2, span=(2, 2), clauses=(4, 4))
    vocab = data.synthetic_vocabulary()
    for line in corpus["train"]["text"][:]:
        tokens = line.split()
        first = tokens[tokens.index(data.SPAN_MARK) + 1 :][:2]
        repeats = [tokens[i + 1 : i + 3] for i, t in enumerate(tokens) if t == data.COPY_MARK]
        assert repeats == [first, first] and tokens[-3:-1] == first
        verbs = vocab["verb_sg"] if tokens[0] == data.DETERMINERS["sg"] else vocab["verb_pl"]
        assert sum(t in verbs for t in tokens) == 4
    with pytest.raises(ValueError, match="span"):
        data.synthetic_corpus(10, 1, 1, span=(4, 2))
    with pytest.raises(ValueError, match="copies"):
        data.synthetic_corpus(10, 1, 1, copies=0)


def test_synthetic_stream_is_far_below_uniform(corpus, word_tokenizer):
    ids = data.token_ids(corpus["train"], word_tokenizer)
    entropy = data.unigram_entropy(ids)
    assert 4.0 < entropy < math.log(len(word_tokenizer))
    assert data.unigram_entropy(torch.tensor([1, 2, 3, 4] * 5)) == pytest.approx(math.log(4))


# -- loading text ------------------------------------------------------------------------------


def test_load_text_files_keeps_lines_in_order(tmp_path):
    lines = {"train": ["a b c", "", " = Head = ", "d e", ""], "test": ["x", "", "y z"]}
    files = {}
    for split, rows in lines.items():
        files[split] = tmp_path / f"{split}.txt"
        files[split].write_text("\n".join(rows) + "\n")
    loaded = data.load_text_splits(files)
    assert {split: loaded[split]["text"][:] for split in loaded} == lines
    from_dir = data.load_text_splits(tmp_path)
    assert {split: from_dir[split]["text"][:] for split in from_dir} == lines


def test_load_text_files_errors_name_the_path(tmp_path):
    (tmp_path / "test.txt").write_text("x\n")
    missing = tmp_path / "nope" / "valid.txt"
    with pytest.raises(FileNotFoundError, match="valid") as err:
        data.load_text_splits({"test": tmp_path / "test.txt", "valid": missing})
    assert str(missing) in str(err.value)
    with pytest.raises(ValueError, match="empty"):
        data.load_text_splits({})
    with pytest.raises(ValueError, match="mapping"):
        data.load_text_splits(tmp_path / "test.txt")
    with pytest.raises(FileNotFoundError, match="other.txt"):
        data.load_text_splits(tmp_path / "other.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no train.txt"):
        data.load_text_splits(tmp_path / "empty")


def test_load_text_from_hub_maps_split_names(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        rows = {"sentence": ["one", "two"], "label": [0, 1]}
        return datasets.DatasetDict({s: datasets.Dataset.from_dict(rows) for s in ("train", "validation", "test")})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    loaded = data.load_text_splits("someone/corpus", "config", text_column="sentence")
    assert calls == [("someone/corpus", "config")]
    assert list(loaded) == ["train", "valid", "test"]
    assert loaded["valid"].column_names == ["text"] and loaded["valid"]["text"][:] == ["one", "two"]
    with pytest.raises(ValueError, match="no column"):
        data.load_text_splits("someone/corpus", "config", text_column="missing")


# -- tokenizers --------------------------------------------------------------------------------


@pytest.mark.parametrize("mlm", [False, True])
def test_word_tokenizer_round_trip(corpus, tmp_path, mlm):
    tokenizer = data.train_tokenizer(corpus["train"], "word", mlm=mlm)
    tokenizer.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    line = corpus["test"]["text"][0]
    for tok in (tokenizer, again):
        ids = tok(line, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(line.split()) and tok.unk_token_id not in ids
        assert tok.decode(ids) == line
        assert tok("zzzqx", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
        assert tok.pad_token_id == 0 and tok.eos_token == data.EOS and tok.bos_token == data.BOS
    assert again.get_vocab() == tokenizer.get_vocab()
    with_special = again(line)["input_ids"]
    if mlm:
        assert again.mask_token == data.MASK
        assert with_special[0] == again.cls_token_id and with_special[-1] == again.sep_token_id
    else:
        assert again.mask_token is None and len(with_special) == len(line.split())


def test_word_tokenizer_vocab_size_and_errors(corpus):
    small = data.train_tokenizer(corpus["train"]["text"][:], "word", vocab_size=50)
    assert len(small) == 50
    with pytest.raises(ValueError, match="kind"):
        data.train_tokenizer(["a b"], "char")
    with pytest.raises(ValueError, match="one string"):
        data.train_tokenizer("a b c", "word")


def test_bpe_tokenizer_round_trip(corpus, tmp_path):
    tokenizer = data.train_tokenizer(corpus, "bpe", vocab_size=600)  # a DatasetDict: its train split
    assert len(tokenizer) <= 600
    tokenizer.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = corpus["test"]["text"][0] + "\n" + corpus["test"]["text"][1] + "\nunseen wörds ÷"
    for tok in (tokenizer, again):
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert len(again(" ditto", add_special_tokens=False)["input_ids"]) == 1  # a frequent word is one token


def test_load_model_tokenizer_splits_gguf_paths(monkeypatch, tmp_path):
    calls = []

    class Fake:
        pad_token, eos_token = None, "</s>"

    def fake(path, gguf_file=None, **kwargs):
        calls.append((path, gguf_file))
        return Fake()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    tok = data.load_model_tokenizer(tmp_path / "model.Q8_0.gguf")
    assert calls == [(str(tmp_path), "model.Q8_0.gguf")] and tok.pad_token == "</s>"
    data.load_model_tokenizer("org/model", gguf_file="x.gguf")
    assert calls[-1] == ("org/model", "x.gguf")


def test_load_model_tokenizer_bert():
    from conftest import minilm_dir

    tok = data.load_model_tokenizer(minilm_dir())
    assert tok.mask_token_id is not None and tok.pad_token_id is not None


# -- token streams and blocks ------------------------------------------------------------------


def test_token_ids_word_level_separates_lines_with_eos(word_tokenizer):
    lines = ["lo fladoo", "", "li fladoo fladoo", "   "]
    ids = data.token_ids(datasets.Dataset.from_dict({"text": lines}), word_tokenizer)
    eos = word_tokenizer.eos_token_id
    expected = [*word_tokenizer.convert_tokens_to_ids(["lo", "fladoo"]), eos]
    expected += [*word_tokenizer.convert_tokens_to_ids(["li", "fladoo", "fladoo"]), eos]
    assert ids.dtype == torch.long and ids.tolist() == expected
    with_bos = data.token_ids(lines, word_tokenizer, bos=True)
    assert with_bos.tolist() == [word_tokenizer.bos_token_id, *expected]
    with pytest.raises(ValueError, match="separator"):
        data.token_ids(lines, word_tokenizer, separator="space")


def test_token_ids_bpe_joins_lines_with_newlines(corpus):
    tokenizer = data.train_tokenizer(corpus["train"], "bpe", vocab_size=600)
    lines = corpus["test"]["text"][:5] + ["", "end"]
    ids = data.token_ids(lines, tokenizer)
    assert tokenizer.decode(ids) == "\n".join(lines)
    assert data.token_ids(lines, tokenizer, separator="eos").tolist().count(tokenizer.eos_token_id) == 6


def test_lm_blocks_chunk_the_stream(word_tokenizer, corpus):
    ids = torch.arange(103)
    blocks = data.lm_blocks(ids, 10)
    assert blocks.column_names == ["input_ids"] and len(blocks) == 10
    assert torch.tensor(blocks["input_ids"][:]).reshape(-1).tolist() == list(range(100))
    wrapped = data.lm_blocks(ids, 10, cls_id=-1, sep_id=-2)["input_ids"][:]
    assert len(wrapped) == 12 and wrapped[1] == [-1, *range(8, 16), -2]
    with pytest.raises(ValueError, match="no block"):
        data.lm_blocks(torch.arange(5), 10)

    stream = data.token_ids(corpus["train"], word_tokenizer)
    dataset = data.lm_blocks(stream, 32)
    collate = transformers.DataCollatorForLanguageModeling(word_tokenizer, mlm=False)
    batch = collate([dataset[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 32) and torch.equal(batch["labels"], batch["input_ids"])

    mlm_tokenizer = data.train_tokenizer(corpus["train"], "word", mlm=True)
    stream = data.token_ids(corpus["train"], mlm_tokenizer)
    dataset = data.lm_blocks(stream, 32, cls_id=mlm_tokenizer.cls_token_id, sep_id=mlm_tokenizer.sep_token_id)
    collate = transformers.DataCollatorForLanguageModeling(mlm_tokenizer, mlm=True, seed=0)
    batch = collate([dataset[i] for i in range(8)])
    assert (batch["labels"] != -100).any() and (batch["input_ids"] == mlm_tokenizer.mask_token_id).any()
    assert (batch["labels"][:, 0] == -100).all()  # [CLS] is never a target


# -- WikiText-2 --------------------------------------------------------------------------------


def test_wikitext_word_tokenizer_covers_test_split():
    wikitext("valid"), wikitext("test")  # skip where absent
    splits = data.load_text_splits({"valid": WIKITEXT / "valid.txt", "test": WIKITEXT / "test.txt"})
    assert len(splits["test"]) == 4358 and splits["test"]["text"][1] == " = Robert <unk> = "
    tokenizer = data.train_tokenizer(splits["valid"], "word")
    ids = data.token_ids(splits["test"], tokenizer)
    unknown = (ids == tokenizer.unk_token_id).float().mean().item()
    assert 0 < unknown < 0.08  # the valid split's words cover ~95% of the test split's tokens
