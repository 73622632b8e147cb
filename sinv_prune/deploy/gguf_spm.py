"""SentencePiece vocabularies (LLaMA-2, Mistral v0.1, TinyLlama ``tokenizer.model``) as llama.cpp's "llama" tokenizer.

The keys are those llama.cpp's ``convert_hf_to_gguf.py`` writes in ``_set_vocab_sentencepiece``: every
piece of the SentencePiece model with its score and type (NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE),
the transformers tokenizer's added tokens over them (CONTROL when special, else USER_DEFINED with
``▁`` turned back into a space, score -1000), ids the model lacks as ``[PAD{i}]`` UNUSED up to the
embedding size, then the special ids, add-BOS/EOS and chat template from ``gguf.SpecialVocab``.

llama.cpp's "llama" tokenizer merges by score as SentencePiece BPE does, on the raw text with spaces
escaped to ``▁`` and an optional leading space; it has no normaliser. A Unigram model, or one whose
normaliser rewrites text (NFKC, squeezed spaces), is refused rather than written to tokenize differently.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import gguf

from sinv_prune.deploy.errors import ExportRefused
from sinv_prune.log_level import log_level

SPACE = "\u2581"  # SentencePiece's visible space


def sentencepiece_file(tokenizer) -> Path | None:
    """The ``tokenizer.model`` a transformers tokenizer was built from, if it has one and it is SentencePiece."""
    vocab_file = getattr(tokenizer, "vocab_file", None)
    if not isinstance(vocab_file, str | Path) or not str(vocab_file).endswith(".model"):
        return None
    path = Path(vocab_file)
    return path if path.is_file() and _load_proto(path) is not None else None


def _sentencepiece():
    """The ``sentencepiece`` package (with protobuf), or a one-line error naming the pip command."""
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise ExportRefused(
            "cannot export a SentencePiece tokenizer without sentencepiece: pip install sentencepiece protobuf"
        ) from None
    return sentencepiece, sentencepiece_model_pb2


def _load_proto(path: Path):
    """The parsed SentencePiece ``ModelProto``, or None when the file is not one (a tiktoken ``.model``)."""
    _, sentencepiece_model_pb2 = _sentencepiece()
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception:  # protobuf raises its own DecodeError, or others on foreign bytes
        return None
    return proto if len(proto.pieces) else None


def refusal(path: Path) -> str | None:
    """Why llama.cpp would tokenize this SentencePiece model differently, or None when it would not."""
    _, sentencepiece_model_pb2 = _sentencepiece()

    proto = _load_proto(path)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(spec.model_type)
        return f"a SentencePiece {kind} model (llama.cpp's 'llama' tokenizer is SentencePiece BPE)"
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        return f"its SentencePiece normaliser {norm.name!r} rewrites text, which llama.cpp does not"
    if norm.remove_extra_whitespaces:
        return "its SentencePiece model squeezes repeated spaces, which llama.cpp does not"
    return None


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, tokenizer, path: Path, n_vocab: int) -> str:
    """Write the "llama" tokenizer keys for ``tokenizer`` built from the SentencePiece model ``path``."""
    reason = refusal(path)
    if reason is not None:
        raise ExportRefused(f"cannot export the tokenizer: {reason}; export from the model's GGUF file or without one")
    sp = _sentencepiece()[0].SentencePieceProcessor(model_file=str(path))
    top = max([sp.vocab_size() - 1, *tokenizer.added_tokens_decoder])
    if top >= n_vocab:
        raise ExportRefused(f"cannot export the tokenizer: ids up to {top}, the model embeds only {n_vocab}")
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [gguf.TokenType.UNUSED] * n_vocab
    for i in range(sp.vocab_size()):
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), _piece_type(sp, i)
    for i, added in tokenizer.added_tokens_decoder.items():
        text = added.content if added.special else added.content.replace(SPACE, " ")
        tokens[i], scores[i] = text.encode("utf-8"), -1000.0
        types[i] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(bool(_load_proto(path).normalizer_spec.add_dummy_prefix))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        with log_level("gguf.vocab", logging.ERROR):  # it warns of the pair template's '<s>', which it skips
            special = gguf.SpecialVocab(tmp, load_merges=False, n_vocab=n_vocab)
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token and getattr(tokenizer, "add_bos_token", None) is not None:
        writer.add_add_bos_token(bool(tokenizer.add_bos_token))
    return f"built from the transformers tokenizer (SentencePiece BPE, {sp.vocab_size()} pieces)"


def _piece_type(sp, i: int) -> gguf.TokenType:
    """A SentencePiece piece's llama.cpp token type (the order convert_hf_to_gguf.py tests them in)."""
    if sp.IsUnknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.IsControl(i):
        return gguf.TokenType.CONTROL
    if sp.IsUnused(i):
        return gguf.TokenType.UNUSED
    if sp.IsByte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL
