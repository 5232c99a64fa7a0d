"""A tiny Qwen3 GGUF that thinks: SmolLM2's tokenizer with `<think>` and `</think>` added as
user-defined tokens (as llama.cpp's converter writes Qwen3's), Qwen3's own chat template, and
weights that make greedy decoding follow a fixed chain of tokens.

The layer's attention and FFN outputs are zero, so the logits are `output @ rmsnorm(embed[t])`
of the last token t alone; each output row of the chain's next token is its predecessor's
embedding (scaled), so greedy decoding after the prompt's last token writes
`<think>THOUGHT</think>\\n\\nANSWER` and then EOS. A prompt that ends with the thinking switched
off (`</think>\\n\\n`) answers at once. Masked tokens fall to the other rows' small random
logits, so a constrained reply still ends. Owns: that file. Does not own: the template text
(chat_templates.py) or the tokenizer copy (gguf_tokenizers.py's conventions).
"""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np

from justapi.frontend.text.tokenizer import TOKEN_USER_DEFINED, Tokenizer
from justapi.model.gguf_file import GGUFFile
from tests.support.api_stack import smollm_gguf
from tests.support.chat_templates import QWEN3
from tests.support.gguf_tokenizers import OverriddenGGUF

MARKERS = ("<think>", "</think>")
THOUGHT = "Hmm, the user greets me so I greet back"
ANSWER = "Hello there friend!"
REPLY = f"<think>{THOUGHT}</think>{ANSWER}"
"""What the model writes (greedy) after a prompt that ends with a newline (every token of it
distinct, and none a newline)."""
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 96
CHAIN_SCALE = 4.0
NOISE_SCALE = 0.01


def write_thinking_gguf(path: Path) -> Path:
    """Write the model to `path` (about 25 MB, F32)."""
    source = smollm_gguf()
    tokens = [*source.get("tokenizer.ggml.tokens"), *MARKERS]
    writer = gguf.GGUFWriter(str(path), "qwen3")
    _write_metadata(writer, source, tokens)
    embed, output = _chain_weights(len(tokens))
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output.weight", output)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for name, shape in _layer_shapes().items():
        zero = name in ("attn_output", "ffn_down")
        rng = np.random.default_rng(len(name))
        value = np.zeros(shape, np.float32) if zero else \
            (np.ones(shape) if name.endswith("norm") else 0.1 * rng.standard_normal(shape))
        writer.add_tensor(f"blk.0.{name}.weight", value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reply_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The chain: the reply's tokens, each one distinct."""
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert len(set(ids)) == len(ids), "the chain's tokens must be distinct"
    return ids


def _write_metadata(writer: gguf.GGUFWriter, source: GGUFFile, tokens: list[str]) -> None:
    writer.add_name("tiny-qwen3-thinking")
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    types = [*source.get("tokenizer.ggml.token_type"), *[TOKEN_USER_DEFINED] * len(MARKERS)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(source.get("tokenizer.ggml.pre")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(source.get("tokenizer.ggml.merges")))
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = source.get(f"tokenizer.ggml.{key}")
        if value is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}", int(value))
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN3)


def _layer_shapes() -> dict[str, tuple[int, ...]]:
    return {"attn_norm": (HIDDEN,), "attn_q": (HEADS * HEAD_DIM, HIDDEN),
            "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output": (HIDDEN, HEADS * HEAD_DIM), "attn_q_norm": (HEAD_DIM,),
            "attn_k_norm": (HEAD_DIM,), "ffn_norm": (HIDDEN,), "ffn_gate": (FFN, HIDDEN),
            "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


def _chain_weights(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_embd [vocab, hidden], output [vocab, hidden]): output[next] = scale * embed[prev]
    along the chain (newline -> reply tokens -> EOS)."""
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((vocab_size, HIDDEN)).astype(np.float32)
    output = (NOISE_SCALE * rng.standard_normal((vocab_size, HIDDEN))).astype(np.float32)
    tokenizer = thinking_tokenizer()
    assert tokenizer.vocab_size == vocab_size
    chain = reply_token_ids(tokenizer)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and newline[0] not in chain
    steps = [newline[0], *chain, tokenizer.eos_token_id]
    for prev, nxt in zip(steps, steps[1:]):
        output[nxt] = CHAIN_SCALE * embed[prev]
    return embed, output


@functools.lru_cache(maxsize=1)
def thinking_tokenizer() -> Tokenizer:
    """The model's tokenizer: SmolLM2's with the two markers."""
    source = smollm_gguf()
    return Tokenizer.from_gguf(OverriddenGGUF(source, {
        "tokenizer.ggml.tokens": [*source.get("tokenizer.ggml.tokens"), *MARKERS],
        "tokenizer.ggml.token_type": [*source.get("tokenizer.ggml.token_type"),
                                      *[TOKEN_USER_DEFINED] * len(MARKERS)]}))
