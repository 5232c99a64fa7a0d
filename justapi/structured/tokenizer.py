"""The llguidance tokenizer a grammar compiles against: from the model's GGUF tokenizer (its
tokenizers JSON), or from a plain token list (tests and the simulator).

The vocabulary is as wide as the logits (`n_vocab`, the worker's Ready.vocab_size), so a
mask row has exactly ceil(n_vocab / 32) int32 words; ids past the tokenizer's own tokens are
never allowed. Every end-of-generation id counts as EOS: allowed exactly when the grammar
accepts. Owns: that construction. Does not own: the GGUF tokenizer (justapi/frontend/text/).
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance as llg

from justapi.frontend.text.tokenizer import Tokenizer


def mask_words(n_vocab: int) -> int:
    """int32 words per bitmask row."""
    return (n_vocab + 31) // 32


def from_tokenizer(tokenizer: Tokenizer, n_vocab: int = 0) -> llg.LLTokenizer:
    """From the model's own tokenizer (0.3-1.6 s, about 40 MiB for a 49k vocabulary)."""
    eos = sorted(tokenizer.eog_token_ids)
    return from_json(tokenizer.to_json(), n_vocab or tokenizer.vocab_size, eos)


def from_json(tokenizer_json: str, n_vocab: int, eos_token_ids: Sequence[int]) -> llg.LLTokenizer:
    """From a tokenizers JSON document (what Tokenizer.to_json returns)."""
    if not eos_token_ids:
        raise ValueError("structured outputs need the model's end-of-generation token ids")
    return llg.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_token_ids))


class TokenList:
    """A tokenizer over an explicit token list: tokens[i] is token i's bytes; special tokens
    (EOS) are named, never matched by text. Encodes greedily, longest token first."""

    def __init__(self, tokens: Sequence[bytes], eos_token_id: int) -> None:
        self.tokens = [b"\xff" + t if i == eos_token_id else t for i, t in enumerate(tokens)]
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.special_token_ids = [eos_token_id]
        self._by_bytes = {t: i for i, t in enumerate(tokens) if i != eos_token_id}
        self._longest = max(len(t) for t in tokens)

    def __call__(self, text: bytes) -> list[int]:
        out, at = [], 0
        while at < len(text):
            for size in range(min(self._longest, len(text) - at), 0, -1):
                token_id = self._by_bytes.get(text[at:at + size])
                if token_id is not None:
                    out.append(token_id)
                    at += size
                    break
            else:
                raise ValueError(f"no token for byte {text[at]!r}")
        return out

    def ll_tokenizer(self, n_vocab: int = 0) -> llg.LLTokenizer:
        return llg.LLTokenizer(llg.TokenizerWrapper(self), n_vocab=n_vocab or len(self.tokens),
                               eos_token=self.eos_token_id)
