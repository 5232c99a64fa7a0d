"""Test helpers: small GGUF files that carry a tokenizer (and tiny dummy weights).

Owns: writing a SentencePiece (`llama`) tokenizer GGUF trained on the spot with the
`sentencepiece` package, a SentencePiece reference rebuilt from a GGUF's vocabulary, copying the
SmolLM2 tokenizer into a variant GGUF (other `tokenizer.ggml.pre`, no chat template...) and
OverriddenGGUF (a parsed file seen with some keys replaced). Does not own: model weights
(workers/weights/synthetic.py).
"""
from __future__ import annotations

import importlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from justapi.model.gguf_file import GGUFFile

SPM_USER_DEFINED = ("<|user|>", "<|assistant|>")
SPM_VOCAB_SIZE = 600

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
It's a truth universally acknowledged, that a single man in possession of a good fortune
must be in want of a wife. However little known the feelings or views of such a man may be.
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text if c != ' ']
Numbers: 3.14159 2718 1000000 42 and 2024-01-01 at 12:30.
Hello world! hello World? HELLO, world... don't won't can't I'm you're they've we'll she'd
Übermäßig schön, naïve café, ça va? 東京は日本の首都です。 Привет, мир! 안녕하세요 세계
"""


def corpus_lines() -> list[str]:
    return [line for line in _CORPUS.splitlines() if line] * 4


def train_sentencepiece(vocab_size: int = SPM_VOCAB_SIZE) -> bytes:
    """A serialized SentencePiece BPE model with byte fallback, Llama-style normalization."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=1,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=list(SPM_USER_DEFINED), hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return model.getvalue()


def sentencepiece_vocab(processor: Any) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, GGUF token types, the way llama.cpp's converter reads a .model file."""
    tokens, scores, types = [], [], []
    for token_id in range(processor.get_piece_size()):
        piece = processor.id_to_piece(token_id)
        tokens.append(piece)
        scores.append(float(processor.get_score(token_id)))
        if processor.is_unknown(token_id):
            types.append(gguf.TokenType.UNKNOWN)
        elif processor.is_control(token_id):
            types.append(gguf.TokenType.CONTROL)
        elif processor.is_byte(token_id):
            types.append(gguf.TokenType.BYTE)
        elif piece in SPM_USER_DEFINED:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, scores, [int(t) for t in types]


def sentencepiece_from_gguf(gguf_file: GGUFFile) -> Any:
    """A SentencePiece processor over the file's own vocabulary (pieces, scores, types), as the
    reference for a `llama` tokenizer: BPE, byte fallback, whitespace escaped as '▁', the file's
    dummy-prefix flag. llama.cpp's converter stores a user-defined whitespace piece ('▁▁') as real
    spaces; it is spelled back here, since SentencePiece matches pieces after escaping."""
    import sentencepiece as spm
    # protobuf's generated module: its classes are made at import, so typed as Any
    model_pb2: Any = importlib.import_module("sentencepiece.sentencepiece_model_pb2")

    kinds = model_pb2.ModelProto.SentencePiece
    type_of = {1: kinds.NORMAL, 2: kinds.UNKNOWN, 3: kinds.CONTROL, 4: kinds.USER_DEFINED,
               5: kinds.UNUSED, 6: kinds.BYTE}
    proto = model_pb2.ModelProto()
    for token, score, token_type in zip(gguf_file.get("tokenizer.ggml.tokens"),
                                        gguf_file.get("tokenizer.ggml.scores"),
                                        gguf_file.get("tokenizer.ggml.token_type"), strict=True):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "\u2581") if token_type == 4 else token
        piece.score, piece.type = float(score), type_of[int(token_type)]
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(proto.pieces)
    proto.trainer_spec.unk_id = int(gguf_file.get("tokenizer.ggml.unknown_token_id", 0))
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(
        gguf_file.get("tokenizer.ggml.add_space_prefix", True))
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def write_spm_gguf(path: Path, processor: Any, add_space_prefix: bool = True,
                   chat_template: str | None = None) -> Path:
    tokens, scores, types = sentencepiece_vocab(processor)
    writer = _llama_writer(path, len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    _finish(writer)
    return path


def copy_tokenizer_gguf(path: Path, source: GGUFFile, overrides: dict[str, Any]) -> Path:
    """The source file's tokenizer metadata with `overrides` (value None drops a key)."""
    tokens = source.get("tokenizer.ggml.tokens")
    writer = _llama_writer(path, len(tokens))
    values = {key: source.get(key) for key in source.reader.fields if key.startswith("tokenizer.")}
    values.update(overrides)
    for key, value in values.items():
        if value is not None:
            _add_value(writer, key, value)
    _finish(writer)
    return path


class OverriddenGGUF(GGUFFile):
    """A parsed GGUF seen with some metadata replaced (value None hides a key), without a copy."""

    def __init__(self, base: GGUFFile, overrides: dict[str, Any]) -> None:  # noqa: no re-parse
        self.__dict__.update(base.__dict__)
        self._overrides = overrides

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._overrides:
            value = self._overrides[key]
            return default if value is None else value
        return super().get(key, default)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, Sequence) and value and isinstance(value[0], str):
        writer.add_array(key, list(value))
    elif isinstance(value, Sequence) and value and isinstance(value[0], float):
        writer.add_array(key, [float(v) for v in value])
    else:
        writer.add_key_value(key, np.asarray(value, dtype=np.int32).tolist(),
                             gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)


def _llama_writer(path: Path, vocab_size: int) -> gguf.GGUFWriter:
    """A GGUF with llama hyper-parameters and tiny dummy tensors, so that HF can load its config."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tokenizer-test")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    return writer


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
