"""The real Gemma 3 vocabulary (262k SentencePiece tokens with byte fallback, whitespace-run
and control tokens, no space prefix): our tokenizer == SentencePiece itself on the same
vocabulary, == HF's ids recorded for this GGUF, and Gemma's stop and template tokens."""
from __future__ import annotations

import pytest

from justapi.frontend.text.tokenizer import Tokenizer
from justapi.model.gguf_file import GGUFFile
from tests.frontend.test_tokenizer import VARIED_TEXTS, random_texts
from tests.support.gemma3 import HF_REFERENCES, gemma3_path
from tests.support.gguf_tokenizers import sentencepiece_from_gguf

pytestmark = pytest.mark.slow

CODE_AND_WHITESPACE = [
    "def f(x):\n    return x  # two spaces\n\n\n\tdone", "  leading", "trailing   ", "a" + " " * 40 + "b",
    "\n" * 40, "<table><tr><td>1</td></tr></table>", "<start_of_turn> is text here",
    "naïve café 東京 😀 \u200b 12345678", "x" * 300,
]


@pytest.fixture(scope="module")
def gemma_gguf() -> GGUFFile:
    return GGUFFile(gemma3_path())


@pytest.fixture(scope="module")
def gemma(gemma_gguf: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_gguf)


def test_gemma_matches_sentencepiece(gemma: Tokenizer, gemma_gguf: GGUFFile) -> None:
    reference = sentencepiece_from_gguf(gemma_gguf)
    texts = VARIED_TEXTS + CODE_AND_WHITESPACE + random_texts(1500, seed=21)
    for text in texts:
        ids = gemma.encode(text, add_special_tokens=False, allow_special=False)
        assert ids == reference.encode(text), text
        assert gemma.decode(ids) == text


def test_gemma_matches_hf_ids(gemma: Tokenizer) -> None:
    for reference in HF_REFERENCES.values():
        assert gemma.encode(reference.text) == list(reference.prompt_ids), reference.text


def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    assert (gemma.bos_token_id, gemma.eos_token_id) == (2, 1)
    assert gemma.special.add_bos_token and not gemma.special.add_eos_token
    assert gemma.eog_token_ids == {1, 106}  # <eos> and <end_of_turn>
    assert gemma.template_tokens["bos_token"] == "<bos>"
    ids = gemma.encode("<start_of_turn>model\nHi<end_of_turn>", add_special_tokens=False)
    assert ids[:3] == [105, 4368, 107] and ids[-1] == 106
    assert gemma.decode(ids) == "model\nHi"  # control tokens dropped, '\n' (user-defined) kept
    plain = gemma.encode("<start_of_turn>", add_special_tokens=False, allow_special=False)
    assert 105 not in plain
