"""Text data for the pipeline: corpora, tokenizers, token streams and training blocks.

* :func:`synthetic_corpus` builds an offline, seeded corpus whose structure needs attention
  (copying, long-range agreement) on top of a local Markov chain;
* :func:`load_text_splits` loads local text files or a Hub dataset as a ``DatasetDict``
  with a ``"text"`` column and splits named ``train`` / ``valid`` / ``test``;
* :func:`train_tokenizer` trains a word-level or byte-level BPE tokenizer with the
  ``tokenizers`` library; :func:`load_model_tokenizer` loads a model's own tokenizer;
* :func:`token_ids` turns a split into one token stream, :func:`lm_blocks` chunks a stream
  into fixed-length blocks for ``transformers.Trainer``.
"""

from __future__ import annotations

import bisect
import math
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import datasets
import torch
import transformers

SPLITS = ("train", "valid", "test")
#: Hub split names mapped to ours; any other name is kept as it is.
HUB_SPLIT_NAMES = {"validation": "valid", "val": "valid", "dev": "valid"}

# Special tokens of the tokenizers trained here ([MASK]/[CLS]/[SEP] only with mlm=True).
PAD, UNK, BOS, EOS, MASK, CLS, SEP = "[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]", "[CLS]", "[SEP]"


# -- synthetic corpus --------------------------------------------------------------------------

#: Marker words of the synthetic corpus.
SPAN_MARK, COPY_MARK, END_MARK = "sa", "ditto", "."
DETERMINERS = {"sg": "lo", "pl": "li"}
NOUN_SUFFIX = {"sg": "o", "pl": "ik"}
VERB_SUFFIX = {"sg": "et", "pl": "unt"}

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "fl",
    "gr",
    "kl",
    "pr",
    "st",
    "tr",
    "sk",
    "sp",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "x"]


def _made_up_words(count: int, rng: random.Random, taken: set[str]) -> list[str]:
    """``count`` distinct pronounceable words (two or three syllables), none in ``taken``."""
    words: list[str] = []
    while len(words) < count:
        syllables = rng.choice((2, 2, 3))
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def synthetic_vocabulary(
    num_nouns: int = 40, num_verbs: int = 30, num_fillers: int = 200, num_names: int = 100
) -> dict[str, list[str]]:
    """The made-up words of :func:`synthetic_corpus`: the same for every corpus seed.

    Keys: ``"noun_sg"``/``"noun_pl"`` and ``"verb_sg"``/``"verb_pl"`` (aligned lists: the same
    stem with the singular or plural suffix), ``"filler"`` (the Markov-chain words),
    ``"name"`` (the words of copied spans) and ``"marker"`` (determiners and markers).
    """
    markers = [*DETERMINERS.values(), SPAN_MARK, COPY_MARK, END_MARK]
    taken = set(markers)
    rng = random.Random(20240229)  # fixed: the vocabulary does not depend on the corpus seed
    stems = _made_up_words(num_nouns + num_verbs, rng, set(taken))
    nouns, verbs = stems[:num_nouns], stems[num_nouns:]
    vocab = {
        "noun_sg": [s + NOUN_SUFFIX["sg"] for s in nouns],
        "noun_pl": [s + NOUN_SUFFIX["pl"] for s in nouns],
        "verb_sg": [s + VERB_SUFFIX["sg"] for s in verbs],
        "verb_pl": [s + VERB_SUFFIX["pl"] for s in verbs],
    }
    for words in vocab.values():
        taken.update(words)
    taken.update(stems)
    vocab["filler"] = _made_up_words(num_fillers, rng, taken)
    vocab["name"] = _made_up_words(num_names, rng, taken)
    vocab["marker"] = markers
    return vocab


def synthetic_corpus(
    num_train: int = 20000,
    num_valid: int = 1000,
    num_test: int = 1000,
    seed: int = 0,
    *,
    clauses: tuple[int, int] = (2, 3),
    gap: tuple[int, int] = (3, 10),
    span: tuple[int, int] = (3, 6),
    branching: int = 4,
    copies: int = 1,
) -> datasets.DatasetDict:
    """An offline corpus (one sentence a line) whose structure attention heads must learn.

    Every line is::

        DET NOUN  chain VERB [sa NAME...]  chain VERB  ...  chain ditto NAME...  .

    * **agreement**: the subject (``lo`` + singular noun, or ``li`` + plural noun) fixes the
      form of every later verb (``-et`` singular, ``-unt`` plural), ``gap`` = 3..10 words apart,
      ``clauses`` = 2..3 verbs a line;
    * **copying**: ``span`` = 3..6 names drawn uniformly from 100 appear after ``sa`` in one
      clause and again, in the same order, after ``ditto`` near the end of the line (``copies``
      times, each after a few chain words): the first occurrence is unpredictable (log 100
      nats a word), the repeats are predictable only by attending back to it (induction);
    * **local structure**: the ``chain`` words follow a random Markov chain over 200 fillers
      (``branching`` = 4 successors per word, random weights). The chain continues across the
      verbs and spans that interrupt it, so the word after an interruption depends on the
      filler before it, a skip-bigram that also needs attention.

    The vocabulary (:func:`synthetic_vocabulary`, about 450 words) is the same for every seed;
    the Markov chain and all lines depend on ``seed`` only, so a corpus is reproducible
    exactly. Splits are drawn from the same process (one random stream: train, valid, test).
    Lines average about 35 words; the defaults give ~700k training words, enough for a small
    GPT-2 to fall well below the unigram entropy in a minute or two on two CPU cores.
    """
    for what, (lo, hi) in {"clauses": clauses, "gap": gap, "span": span}.items():
        if not 1 <= lo <= hi:
            raise ValueError(f"{what} must be (low, high) with 1 <= low <= high, got {(lo, hi)}")
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    vocab = synthetic_vocabulary()
    fillers, names = vocab["filler"], vocab["name"]
    if not 1 <= branching <= len(fillers):
        raise ValueError(f"branching must be in 1..{len(fillers)}, got {branching}")
    rng = random.Random(seed)
    chain = {}
    for word in fillers:
        successors = rng.sample(fillers, branching)
        weights = [rng.expovariate(1.0) for _ in successors]
        cumulative = [sum(weights[: i + 1]) for i in range(branching)]
        chain[word] = (successors, cumulative)

    def walk(state: str, length: int, out: list[str]) -> str:
        for _ in range(length):
            successors, cumulative = chain[state]
            state = successors[bisect.bisect(cumulative, rng.random() * cumulative[-1])]
            out.append(state)
        return state

    def line() -> str:
        number = "sg" if rng.random() < 0.5 else "pl"
        noun = rng.randrange(len(vocab["noun_sg"]))
        words = [DETERMINERS[number], vocab[f"noun_{number}"][noun]]
        copied = [rng.choice(names) for _ in range(rng.randint(*span))]
        count = rng.randint(*clauses)
        span_clause = rng.randrange(count)
        state = rng.choice(fillers)
        for clause in range(count):
            state = walk(state, rng.randint(*gap), words)
            words.append(rng.choice(vocab[f"verb_{number}"]))
            if clause == span_clause:
                words += [SPAN_MARK, *copied]
        for _ in range(copies):
            state = walk(state, rng.randint(1, 3), words)
            words += [COPY_MARK, *copied]
        words.append(END_MARK)
        return " ".join(words)

    sizes = {"train": num_train, "valid": num_valid, "test": num_test}
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"text": [line() for _ in range(n)]}) for split, n in sizes.items()}
    )


# -- loading text ------------------------------------------------------------------------------


def load_text_splits(
    source: str | os.PathLike | Mapping[str, str | os.PathLike | Sequence[str | os.PathLike]],
    name: str | None = None,
    *,
    text_column: str = "text",
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """Text splits as a ``DatasetDict`` with one ``"text"`` column, one row per line.

    ``source`` is one of

    * a mapping split -> local text file (or list of files), e.g.
      ``{"train": "valid.txt", "test": "test.txt"}``: loaded with
      ``datasets.load_dataset("text", data_files=...)``, one row per line in file order,
      blank lines kept as ``""`` and line breaks stripped;
    * a local directory: its ``train.txt``, ``valid.txt`` (or ``validation.txt``) and
      ``test.txt``, those present (at least one);
    * anything else is a Hub dataset: ``datasets.load_dataset(source, name)``, e.g.
      ``("wikitext", "wikitext-2-raw-v1")``; split ``validation`` becomes ``valid`` and
      ``text_column`` is renamed ``"text"`` (other columns are dropped).

    Raises ``FileNotFoundError`` naming the split and path of a missing file, ``ValueError``
    for an empty mapping or an unusable source.
    """
    if isinstance(source, Mapping):
        if not source:
            raise ValueError("load_text_splits: the mapping of split -> file is empty")
        files = {}
        for split, paths in source.items():
            paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
            if not paths:
                raise ValueError(f"load_text_splits: split {split!r} has no files")
            for path in paths:
                if not Path(path).is_file():
                    raise FileNotFoundError(f"load_text_splits: text file for split {split!r} not found: {path}")
            files[str(split)] = [str(Path(p).resolve()) for p in paths]
        return datasets.load_dataset("text", data_files=files, cache_dir=cache_dir)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"load_text_splits: source must be a path, a Hub id or a mapping, got {type(source).__name__}")
    if Path(source).is_dir():
        found = {}
        for split, stems in {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}.items():
            for stem in stems:
                if (Path(source) / f"{stem}.txt").is_file():
                    found[split] = Path(source) / f"{stem}.txt"
                    break
        if not found:
            raise FileNotFoundError(f"load_text_splits: no train.txt, valid.txt or test.txt in directory {source}")
        return load_text_splits(found, cache_dir=cache_dir)
    if Path(source).is_file():
        raise ValueError(
            f"load_text_splits: for a single file pass a mapping split -> file, e.g. {{'test': {source!r}}}"
        )
    if Path(source).suffix in (".txt", ".raw", ".text"):
        # A file name, not a Hub id: say so instead of asking the Hub.
        raise FileNotFoundError(f"load_text_splits: text file not found: {source}")
    loaded = datasets.load_dataset(str(source), name, cache_dir=cache_dir)
    out = {}
    for split, dataset in loaded.items():
        if text_column not in dataset.column_names:
            raise ValueError(f"load_text_splits: {source} split {split!r} has no column {text_column!r}")
        dataset = dataset.select_columns([text_column])
        if text_column != "text":
            dataset = dataset.rename_column(text_column, "text")
        out[HUB_SPLIT_NAMES.get(split, split)] = dataset
    return datasets.DatasetDict(out)


# -- tokenizers --------------------------------------------------------------------------------


def _texts(texts) -> Iterator[str]:
    if isinstance(texts, datasets.DatasetDict):
        if "train" not in texts:
            raise ValueError(f"train_tokenizer: DatasetDict has no 'train' split (splits: {list(texts)})")
        texts = texts["train"]
    if isinstance(texts, datasets.Dataset):
        for start in range(0, len(texts), 1000):
            yield from texts[start : start + 1000]["text"]
        return
    if isinstance(texts, str):
        raise ValueError("train_tokenizer: texts must be an iterable of lines, not one string")
    yield from texts


def train_tokenizer(
    texts: Iterable[str] | datasets.Dataset | datasets.DatasetDict,
    kind: str = "word",
    *,
    vocab_size: int | None = None,
    min_frequency: int = 1,
    mlm: bool = False,
    model_max_length: int = 1_000_000,
) -> transformers.PreTrainedTokenizerFast:
    """Train a tokenizer on ``texts`` (lines; a ``Dataset``'s ``"text"``; a ``DatasetDict``'s train split).

    * ``kind="word"``: one token per whitespace-separated word (``WordLevel`` model,
      ``WhitespaceSplit`` pre-tokenizer; decoding joins with spaces), unknown words map to
      ``[UNK]``. ``vocab_size=None`` keeps every word seen ``min_frequency`` times; otherwise
      the most frequent words (special tokens included in the count).
    * ``kind="bpe"``: byte-level BPE as GPT-2 (no ``[UNK]`` ever needed; newlines are tokens);
      ``vocab_size`` defaults to 8192.

    Special tokens ``[PAD]`` (id 0), ``[UNK]``, ``[BOS]``, ``[EOS]`` and, with ``mlm=True``,
    ``[MASK]``, ``[CLS]`` and ``[SEP]``. With ``mlm=True`` encoding a text with special
    tokens gives ``[CLS] ... [SEP]`` as BERT; otherwise nothing is added (as GPT-2). The
    result saves with ``save_pretrained`` and reloads with ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = [PAD, UNK, BOS, EOS] + ([MASK, CLS, SEP] if mlm else [])
    if kind == "word":
        tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size or 1 << 30, min_frequency=min_frequency, special_tokens=specials, show_progress=False
        )
    elif kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size or 8192,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        raise ValueError(f"train_tokenizer: kind must be 'word' or 'bpe', got {kind!r}")
    tokenizer.train_from_iterator(_texts(texts), trainer=trainer)
    if tokenizer.get_vocab_size() <= len(specials):
        raise ValueError("train_tokenizer: no tokens learned (empty texts?)")
    if mlm:
        cls, sep = tokenizer.token_to_id(CLS), tokenizer.token_to_id(SEP)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1", special_tokens=[(CLS, cls), (SEP, sep)]
        )
    elif kind == "bpe":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    extra = {"mask_token": MASK, "cls_token": CLS, "sep_token": SEP} if mlm else {}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=model_max_length,
        **extra,
    )


def load_model_tokenizer(path_or_id: str | os.PathLike, gguf_file: str | None = None, **kwargs):
    """A model's own tokenizer (``AutoTokenizer.from_pretrained``), also from a GGUF file.

    A path ending in ``.gguf`` is split into its directory and ``gguf_file``. Where the
    tokenizer has no pad token but an EOS token, the EOS token also pads.
    """
    path = Path(path_or_id)
    if gguf_file is None and path.suffix == ".gguf":
        path_or_id, gguf_file = str(path.parent), path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path_or_id), gguf_file=gguf_file, **kwargs)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# -- token streams and blocks ------------------------------------------------------------------


def encodes_newline(tokenizer) -> bool:
    ids = tokenizer("\n", add_special_tokens=False)["input_ids"]
    return bool(ids) and ids != [tokenizer.unk_token_id]


def encode_lines(lines: list[str], tokenizer) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):  # 2x faster than __call__
        return [e.ids for e in backend.encode_batch_fast(lines, add_special_tokens=False)]
    return tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]


def token_ids(
    split: datasets.Dataset | Sequence[str],
    tokenizer,
    *,
    separator: str = "auto",
    bos: bool = False,
    text_column: str = "text",
) -> torch.LongTensor:
    """A whole split as one 1-D stream of token ids, lines in order.

    ``separator``:

    * ``"newline"``: the lines joined with ``"\\n"`` (the original file's text) and encoded in
      one call, as in the Hugging Face perplexity guide; for tokenizers that encode newlines
      (byte-level BPE, SentencePiece, pretrained tokenizers);
    * ``"eos"``: every non-blank line encoded on its own and followed by the EOS token;
      blank lines contribute nothing. For word-level tokenizers, which drop newlines;
    * ``"auto"`` (default): ``"newline"`` where the tokenizer encodes ``"\\n"`` to a known
      token, else ``"eos"``.

    No special tokens are added inside lines; ``bos=True`` puts one BOS token first.
    """
    # A slice is read as one Arrow batch; iterating a datasets Column goes row by row (slow).
    texts = split[0 : len(split)][text_column] if isinstance(split, datasets.Dataset) else list(split)
    if separator == "auto":
        separator = "newline" if encodes_newline(tokenizer) else "eos"
    if separator == "newline":
        ids = tokenizer("\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"]
    elif separator == "eos":
        if tokenizer.eos_token_id is None:
            raise ValueError("token_ids: separator='eos' needs a tokenizer with an EOS token")
        ids = []
        for line in encode_lines([t for t in texts if t.strip()], tokenizer):
            ids += line
            ids.append(tokenizer.eos_token_id)
    else:
        raise ValueError(f"token_ids: separator must be 'auto', 'newline' or 'eos', got {separator!r}")
    if bos:
        if tokenizer.bos_token_id is None:
            raise ValueError("token_ids: bos=True needs a tokenizer with a BOS token")
        ids = [tokenizer.bos_token_id, *ids]
    return torch.tensor(ids, dtype=torch.long)


def block_tensor(
    ids: torch.Tensor, seq_len: int, *, cls_id: int | None = None, sep_id: int | None = None, keep_last: bool = False
) -> list[torch.Tensor]:
    """Consecutive blocks of ``seq_len`` tokens; with ``cls_id``/``sep_id`` each block is
    ``[CLS] + seq_len - 2 stream tokens + [SEP]`` (``seq_len`` in total).

    Returns ``[full blocks as one [n, seq_len] tensor]`` plus, with ``keep_last``, the
    shorter final block (if any) as a ``[1, k]`` tensor; the remainder is otherwise dropped.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    prefix = [cls_id] if cls_id is not None else []
    suffix = [sep_id] if sep_id is not None else []
    body = seq_len - len(prefix) - len(suffix)
    if body < 1:
        raise ValueError(f"seq_len {seq_len} leaves no room for tokens between the special tokens")
    n = ids.numel() // body
    full = ids[: n * body].reshape(n, body)
    if prefix or suffix:
        columns = [torch.full((n, 1), tok, dtype=torch.long) for tok in prefix]
        columns += [full] + [torch.full((n, 1), tok, dtype=torch.long) for tok in suffix]
        full = torch.cat(columns, dim=1)
    out = [full]
    rest = ids[n * body :]
    if keep_last and rest.numel():
        out.append(torch.tensor([*prefix, *rest.tolist(), *suffix], dtype=torch.long)[None])
    return out


def lm_blocks(
    ids: torch.Tensor, seq_len: int, *, cls_id: int | None = None, sep_id: int | None = None
) -> datasets.Dataset:
    """A ``Dataset`` of ``input_ids`` blocks of exactly ``seq_len`` tokens (concatenate and chunk).

    The stream is cut into consecutive non-overlapping blocks; the remainder shorter than a
    block is dropped. For masked LMs pass ``cls_id``/``sep_id`` to wrap every block as
    ``[CLS] ... [SEP]``. Ready for ``transformers.Trainer`` with
    ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` (causal) or ``mlm=True``.
    """
    (blocks,) = block_tensor(ids, seq_len, cls_id=cls_id, sep_id=sep_id)
    if not len(blocks):
        raise ValueError(f"lm_blocks: {len(ids)} tokens make no block of {seq_len}")
    return datasets.Dataset.from_dict({"input_ids": blocks.tolist()})


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy (nats per token) of the stream's own unigram distribution: the loss a model that
    ignores context can at best reach on this stream; a baseline for a trained model's NLL."""
    counts = torch.bincount(torch.as_tensor(ids).reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum()) if p.numel() else math.nan
