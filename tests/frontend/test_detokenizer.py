"""Incremental detokenizer (streamed text == decode(all), never a broken character, O(window)
decodes) and stop strings (matched across chunks, never leaked, held only while ambiguous)."""
from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from justapi.frontend.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.model.gguf_file import GGUFFile, default_model_path

MULTIBYTE_TEXTS = [
    "Hello world, plain ASCII.", "日本語のテキストです。東京タワー", "中文文本，包括标点符号！",
    "한국어 텍스트입니다", "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ end", "e\u0301 a\u0308 n\u0303 क्ष",
    "שלום עולם مرحبا بالعالم", "naïve café résumé Straße", "∑ ∫ √ ∞ ≠ ½ ² Ⅻ",
    "  spaces\n\nand\ttabs  ", "<|im_start|>assistant\nDone 🎉<|im_end|>", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 🀄",
]


def _random_text(rng: random.Random) -> str:
    pools = ["abc xyz", "日本語中文한국어", "😀👍🏽🇫🇷❤️🎉", "éàçüß", "\u0301\u0308", " \n\t", "0123"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))


def stream(detokenizer: IncrementalDetokenizer, token_ids: Sequence[int],
           rng: random.Random | None = None) -> list[str]:
    """Feed ids one at a time (or in random chunks of 1-4); the chunks, flush last."""
    chunks, index = [], 0
    while index < len(token_ids):
        size = rng.randint(1, 4) if rng else 1
        chunks.append(detokenizer.add(token_ids[index:index + size]))
        index += size
    chunks.append(detokenizer.flush())
    return chunks


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm_stream_equals_decode(smol: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    texts = MULTIBYTE_TEXTS + [_random_text(rng) for _ in range(300)]
    for text in texts:
        ids = smol.encode(text)
        full = smol.decode(ids, skip_special_tokens=skip_special_tokens)
        for chunking in (None, rng):
            chunks = stream(IncrementalDetokenizer(smol, skip_special_tokens), ids, chunking)
            assert "".join(chunks) == full, text
            assert not any("\ufffd" in chunk for chunk in chunks), (text, chunks)


@pytest.mark.slow
def test_smollm_holds_back_split_emoji(smol: Tokenizer) -> None:
    ids = smol.encode("a 😀")
    assert [smol.id_to_token(i) for i in ids] == ["a", "ĠðŁĺ", "Ģ"]  # the emoji's 4th byte apart
    detokenizer = IncrementalDetokenizer(smol)
    assert [detokenizer.add([i]) for i in ids] == ["a", "", " 😀"]
    assert detokenizer.flush() == ""


@pytest.mark.slow
def test_random_ids_stream_equals_decode(smol: Tokenizer) -> None:
    """Arbitrary byte tokens (broken UTF-8 on purpose): the stream still adds up to decode()."""
    rng = random.Random(1)
    byte_token_ids = [i for i in range(smol.vocab_size) if len(smol.id_to_token(i)) == 1]
    for _ in range(300):
        ids = [rng.choice(byte_token_ids if rng.random() < 0.7 else range(smol.vocab_size))
               for _ in range(rng.randint(1, 20))]
        chunks = stream(IncrementalDetokenizer(smol, skip_special_tokens=False), ids, rng)
        assert "".join(chunks) == smol.decode(ids, skip_special_tokens=False)


@pytest.mark.slow
def test_prompt_context_gives_the_first_token_its_text(smol: Tokenizer) -> None:
    prompt, output = smol.encode("The capital is"), smol.encode(" Paris, 東京")
    detokenizer = IncrementalDetokenizer(smol, prompt_token_ids=prompt)
    text = "".join(stream(detokenizer, output))
    assert text == " Paris, 東京"


class CountingTokenizer:
    """Records how many ids each decode call receives."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.slow
def test_decode_work_per_step_is_bounded(smol: Tokenizer) -> None:
    ids = smol.encode("日本語 and English, 😀 emoji. " * 200)
    counting = CountingTokenizer(smol)
    detokenizer = IncrementalDetokenizer(counting, prompt_token_ids=ids[:50])  # type: ignore[arg-type]
    chunks = stream(detokenizer, ids)
    assert "".join(chunks) == smol.decode(ids)
    assert len(ids) > 1500 and max(counting.sizes) <= 8


# -- SentencePiece: leading-space rule and byte fallback --------------------------------------

@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory) -> Tokenizer:
    spm = pytest.importorskip("sentencepiece")
    from tests.support.gguf_tokenizers import train_sentencepiece, write_spm_gguf

    processor = spm.SentencePieceProcessor(model_proto=train_sentencepiece())
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", processor)
    return Tokenizer.from_gguf(GGUFFile(str(path)))


def test_spm_stream_equals_decode(spm_tok: Tokenizer) -> None:
    rng = random.Random(2)
    for text in [t for t in MULTIBYTE_TEXTS if "<" not in t] + ["龍が 飛ぶ 🐉 dragon", "x"]:
        ids = spm_tok.encode(text)
        for chunking in (None, rng):
            chunks = stream(IncrementalDetokenizer(spm_tok), ids, chunking)
            assert "".join(chunks) == spm_tok.decode(ids) == text
            assert not any("\ufffd" in chunk for chunk in chunks)


def test_spm_leading_space_rules(spm_tok: Tokenizer) -> None:
    ids = spm_tok.encode("Hello world", add_special_tokens=False)
    fresh = IncrementalDetokenizer(spm_tok)
    assert fresh.add(ids[:1]) == "Hello"  # start of text: the prefix space is not text
    assert fresh.add(ids[1:]) == " world"  # mid-stream: '▁world' is a space and a word
    prompt = spm_tok.encode("Say")
    after_prompt = IncrementalDetokenizer(spm_tok, prompt_token_ids=prompt)
    assert after_prompt.add(ids[:1]) == " Hello"


def test_spm_byte_fallback_is_held_until_whole(spm_tok: Tokenizer) -> None:
    ids = spm_tok.encode("a龍", add_special_tokens=False)
    assert [spm_tok.id_to_token(i) for i in ids][-3:] == ["<0xE9>", "<0xBE>", "<0x8D>"]
    detokenizer = IncrementalDetokenizer(spm_tok)
    assert [detokenizer.add([i]) for i in ids] == ["a", "", "", "龍"]


# -- stop strings ------------------------------------------------------------------------------

def feed_all(matcher: StopStringMatcher, chunks: Sequence[str]) -> tuple[list[str], bool]:
    out = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        out.append(text)
        if matched:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_across_chunks_is_never_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P more") == ("", True)
    assert matcher.matched_stop == "STOP"
    assert matcher.feed("later") == ("", True) and matcher.flush() == ""


def test_held_text_is_released_when_it_cannot_match() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("d") == ("abd", False)
    assert matcher.feed("a") == ("", False)
    assert matcher.flush() == "a"


def test_overlapping_candidates() -> None:
    matcher = StopStringMatcher(["abcd", "bcx"])
    assert feed_all(matcher, ["ab", "c", "x", "y"]) == (["", "", "a"], True)
    assert matcher.matched_stop == "bcx"
    matcher = StopStringMatcher(["aab"])
    assert feed_all(matcher, ["a", "a", "a", "b", "c"]) == (["", "", "a", ""], True)
    matcher = StopStringMatcher([" ", "a a"])  # ' ' completes first, whatever the chunking
    assert feed_all(matcher, ["a a"]) == (["a"], True) and matcher.matched_stop == " "
    matcher = StopStringMatcher(["b", "ab"])  # both complete at once: the earlier start wins
    assert feed_all(matcher, ["xab"]) == (["x"], True) and matcher.matched_stop == "ab"
    matcher = StopStringMatcher(["\n\n", "User:"])
    assert feed_all(matcher, ["Hi\n", "Use", "r: x"]) == (["Hi", "\n", ""], True)


@pytest.mark.parametrize("bad", [[], [""], "STOP", ["ok", 3], ["x"] * 33, ["y" * 1025]])
def test_bad_stop_lists_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(bad)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="ab c\n😀", max_size=30),
       stops=st.lists(st.text(alphabet="ab c\n😀", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_property(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, matched = feed_all(StopStringMatcher(stops), chunks)
    # The first stop to be completed wins (earliest end, then earliest start).
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[:min(hits)[1]] if hits else text
    assert "".join(out) == expected and matched == bool(hits)


@pytest.mark.slow
def test_detokenizer_and_stop_strings_together(smol: Tokenizer) -> None:
    text = "Answer: 東京 is big.\nUser: next question"
    ids = smol.encode(text)
    detokenizer, matcher = IncrementalDetokenizer(smol), StopStringMatcher(["\nUser:", "zzz"])
    shown = []
    for token_id in ids:
        piece, matched = matcher.feed(detokenizer.add([token_id]))
        shown.append(piece)
        if matched:
            break
    assert "".join(shown) == "Answer: 東京 is big." and matcher.matched_stop == "\nUser:"
