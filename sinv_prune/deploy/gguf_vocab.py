"""The tokenizer part of a GGUF file: copied from a source GGUF, or built from a Hugging Face tokenizer.

* **From a GGUF file** (the model came from one): every ``tokenizer.*`` key (vocabulary, merges,
  special ids, pre-tokenizer name, chat template) is copied as it is, so llama.cpp tokenizes
  exactly as it did for the source.
* **From a SentencePiece tokenizer** (one built from a ``tokenizer.model``: LLaMA-2, Mistral v0.1,
  TinyLlama): llama.cpp's "llama" tokenizer with scores and token types
  (:mod:`sinv_prune.deploy.gguf_spm`).
* **From a byte-level BPE transformers tokenizer**: saved to a temporary folder and read back with ``gguf.vocab``
  (``BpeVocab`` for byte-level BPE, ``SpecialVocab`` for merges, special ids, add-BOS/EOS and the
  chat template). llama.cpp splits text with a pre-tokenizer it knows by name; the name is found
  as llama.cpp's ``convert_hf_to_gguf.py`` finds it, by the hash of the token ids of a fixed text
  (:mod:`sinv_prune.deploy.pre_tokenizers`). A tokenizer whose hash is unknown, or that is not
  byte-level BPE, is refused rather than written to tokenize differently.
* **No tokenizer**: a vocabulary-free file (``tokenizer.ggml.model = "none"``): llama.cpp takes
  token ids and returns logits, and cannot tokenize text.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import gguf

from sinv_prune.deploy.errors import ExportRefused
from sinv_prune.deploy.gguf_spm import add_sentencepiece_vocab, sentencepiece_file
from sinv_prune.deploy.pre_tokenizers import CHECK_TEXT, PRE_TOKENIZERS


def add_vocab(writer: gguf.GGUFWriter, tokenizer, n_vocab: int, source_gguf: str | Path | None) -> str:
    """Write the tokenizer keys; returns where they came from (for the summary)."""
    if source_gguf is not None:
        copy_tokenizer(writer, Path(source_gguf), n_vocab)
        return f"copied from {Path(source_gguf).name}"
    if tokenizer is None:
        writer.add_tokenizer_model("none")  # llama.cpp sizes the vocabulary from <arch>.vocab_size
        return "none (vocabulary-free: token ids in, logits out)"
    spm = sentencepiece_file(tokenizer)
    if spm is not None:
        return add_sentencepiece_vocab(writer, tokenizer, spm, n_vocab)
    return build_from_hf(writer, tokenizer, n_vocab)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path, n_vocab: int) -> None:
    """Copy every ``tokenizer.*`` key of ``source`` (a GGUF file) into ``writer``."""
    reader = gguf.GGUFReader(source)
    tokens = reader.fields.get(gguf.Keys.Tokenizer.LIST)
    if tokens is not None and len(tokens.data) != n_vocab:
        raise ExportRefused(
            f"cannot copy the tokenizer of {source.name}: {len(tokens.data)} tokens, the model embeds {n_vocab}"
        )
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [bytes(field.parts[i]) if sub == gguf.GGUFValueType.STRING else field.parts[i][0].item()
                      for i in field.data]  # fmt: skip
            writer.add_key_value(key, values, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            writer.add_key_value(key, field.parts[field.data[0]][0].item(), kind)


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, by the hash convert_hf_to_gguf.py uses."""
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise ExportRefused(
            f"cannot export the tokenizer: llama.cpp does not know its pre-tokenizer (hash {digest[:12]}...); "
            "export from the model's GGUF file (tokenizer_gguf=) or without a tokenizer"
        )
    return PRE_TOKENIZERS[digest]


def build_from_hf(writer: gguf.GGUFWriter, tokenizer, n_vocab: int) -> str:
    """Vocabulary, merges and special tokens of a byte-level BPE transformers tokenizer.

    Token types follow llama.cpp's ``get_vocab_base``: added tokens are CONTROL when special,
    USER_DEFINED otherwise, ids the tokenizer lacks are UNUSED padding up to the embedding size.
    """
    pre = pre_tokenizer_name(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        try:
            gguf.vocab.BpeVocab(Path(tmp))  # raises for anything but byte-level BPE
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise ExportRefused(
                f"cannot export the tokenizer: not byte-level BPE, which is what llama.cpp reads ({err})"
            ) from None
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=n_vocab)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise ExportRefused(
            f"cannot export the tokenizer: ids up to {max(vocab.values())}, the model embeds only {n_vocab}"
        )
    reverse = {i: t for t, i in vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token and getattr(tokenizer, "add_bos_token", None) is not None:
        writer.add_add_bos_token(bool(tokenizer.add_bos_token))
    return f"built from the transformers tokenizer (byte-level BPE, pre-tokenizer {pre!r})"
