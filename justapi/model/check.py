"""Refuse a corrupt or hostile GGUF at `justapi serve` start, in one line, before any process.

GGUFFile already refuses a bad header, truncated metadata or tensor data; ModelInfo refuses
missing or absurd shape metadata. This adds what they do not see: tensor extents beyond the
end of the file, absurd tensor sizes, tensors that disagree with the metadata (embedding
width, vocabulary, layer count), and a chat template that does not compile or does not
render a probe conversation in the sandbox (e.g. one that tries to reach Python internals);
and that a draft model (speculative decoding) shares the model's vocabulary.
Owns: those start-up checks. Does not own: parsing (gguf_file.py) or loading (workers/).
"""
from __future__ import annotations

import os
import re

from justapi.config.serve import ServeConfig
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.info import ModelInfo, resolve_model

MAX_TENSOR_ELEMENTS = 1 << 36  # 64 Gi parameters in one tensor: no real model comes close
PROBE_MESSAGES = [{"role": "user", "content": "Hello!"}]
_LAYER = re.compile(r"blk\.(\d+)\.")


def check_model_file(gguf: GGUFFile, model: ModelInfo) -> None:
    """Raise GGUFError (one line, naming the file and the problem) if `gguf` cannot be served."""
    _check_tensor_extents(gguf)
    _check_tensors_match_metadata(gguf, model)
    _check_chat_template(gguf)


def _check_tensor_extents(gguf: GGUFFile) -> None:
    file_size = os.path.getsize(gguf.path)
    for tensor in gguf.reader.tensors:
        if int(tensor.n_elements) > MAX_TENSOR_ELEMENTS:
            raise GGUFError(f"{gguf.path}: tensor {tensor.name!r} has an absurd size "
                            f"({int(tensor.n_elements)} elements)")
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > file_size:
            raise GGUFError(f"{gguf.path}: tensor {tensor.name!r} ends at byte {end}, past the "
                            f"end of the file ({file_size} bytes): truncated")


def _check_tensors_match_metadata(gguf: GGUFFile, model: ModelInfo) -> None:
    """The tensors every llama model has must have the shapes its metadata promises (the
    worker checks every tensor; this catches a lying header before anything starts)."""
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
    width, vocab = (int(d) for d in embedding.shape[:2])
    if width != model.hidden_size or (model.vocab_size and vocab != model.vocab_size):
        raise GGUFError(f"{gguf.path}: token_embd.weight is {width} x {vocab}, but the metadata "
                        f"says embedding_length {model.hidden_size}, vocabulary "
                        f"{model.vocab_size}")
    layers = {int(m.group(1)) for name in gguf.tensors if (m := _LAYER.match(name))}
    if layers != set(range(model.num_layers)):
        raise GGUFError(f"{gguf.path}: the metadata says {model.num_layers} layers, the file "
                        f"has tensors for {len(layers)} (blk.{min(layers, default=0)}.."
                        f"blk.{max(layers, default=0)})")


def _check_chat_template(gguf: GGUFFile) -> None:
    source = gguf.get("tokenizer.chat_template")
    if not source:
        return  # the frontend serves a built-in template (and says which)
    try:
        ChatTemplate(str(source)).render(PROBE_MESSAGES, add_generation_prompt=True)
    except ValueError as exc:
        raise GGUFError(f"{gguf.path}: chat template rejected: {exc}") from None


def check_draft_model(config: ServeConfig, target: ModelInfo) -> None:
    """A draft model (--draft-model) must be a servable llama GGUF with the target's vocabulary
    (same size and, when both files list them, the same tokens): its ids are the target's."""
    path = config.speculative.draft_model
    if config.speculative.spec != "draft" or not path:
        return
    gguf = GGUFFile(resolve_model(path))
    draft = ModelInfo.from_gguf(gguf)
    _check_tensor_extents(gguf)
    _check_tensors_match_metadata(gguf, draft)
    if draft.vocab_size != target.vocab_size:
        raise GGUFError(f"{gguf.path}: draft model vocabulary has {draft.vocab_size} tokens, the "
                        f"model's has {target.vocab_size}")
    tokens = gguf.get("tokenizer.ggml.tokens")
    target_tokens = GGUFFile(target.path).get("tokenizer.ggml.tokens")
    if tokens is not None and target_tokens is not None and list(tokens) != list(target_tokens):
        raise GGUFError(f"{gguf.path}: draft model tokens differ from the model's (a draft must "
                        "share the tokenizer)")
