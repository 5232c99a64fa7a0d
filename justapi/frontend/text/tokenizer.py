"""The model's tokenizer, rebuilt from a GGUF's own `tokenizer.ggml.*` metadata with `tokenizers`.

Owns: text <-> token ids, the special-token ids (BOS/EOS/PAD/UNK, end-of-generation set) and the
BOS/EOS policy. Supports `gpt2` (byte-level BPE, pre-tokenizer chosen by `tokenizer.ggml.pre`, as
llama.cpp does) and `llama` (SentencePiece BPE: scores, `▁`, byte fallback) as HF's GGUF converter
builds it, with llama.cpp's space-prefix rule. Does not own: chat templates (chat_template.py)
or streaming text (detokenizer.py).
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from justapi.model.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType / llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_BYTE = 1, 2, 3, 4, 6
SPIECE_SPACE = "\u2581"  # '▁', SentencePiece's spelling of a space

# Split regexes per llama.cpp pre-tokenizer family (src/llama-vocab.cpp), applied in order, each
# splitting the pieces of the previous one and keeping what it does not match ("isolated").
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (Nemo, Small 3) and GPT-4o's (Phi-4): the models' own tokenizer.json regexes.
# llama.cpp rewrites their letter classes for its regex engine ([^a-z] letters for \p{Lu}...),
# which splits non-ASCII capitals differently; these follow the models.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek's letter class (cased letters), written as escapes: several of its characters are
# canonical singletons (U+1F7D, U+2126, U+212A...) that editors silently normalize.
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # llama.cpp's fallback for files that name no pre-tokenizer.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "tekken": (_TEKKEN,),
    "gpt-4o": (_GPT4O,),
    # StarCoder / SmolLM: every digit on its own, then GPT-2's split.
    "starcoder": (r"\p{N}", _GPT2),
    "deepseek-llm": (r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     r"\s+$", _CJK, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
}
PRE_TOKENIZER_ALIASES = {
    "gpt-2": "gpt-2", "mpt": "gpt-2", "olmo": "gpt-2", "jais": "gpt-2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3", "pixtral": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "starcoder": "starcoder", "smollm": "starcoder", "refact": "starcoder",
    "command-r": "starcoder", "codeshell": "starcoder", "exaone": "starcoder",
    "minerva": "starcoder",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder", "default": "default",
    "tekken": "tekken", "gpt-4o": "gpt-4o", "llama4": "gpt-4o",
}
# Families whose merges are skipped for a word that is itself a token (llama.cpp ignore_merges).
IGNORE_MERGES_FAMILIES = frozenset({"llama3", "tekken"})
# Byte-level families that add BOS unless the file says otherwise (llama.cpp forces add_bos).
ADD_BOS_FAMILIES = frozenset({"llama3", "tekken"})
# Tokens that end a turn whatever the file's eot/eom ids say (llama.cpp's list).
END_OF_GENERATION_NAMES = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})


@dataclass(frozen=True)
class SpecialTokens:
    """Special-token ids and the BOS/EOS policy read from the file."""

    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    eog_token_ids: frozenset[int]
    """Ids that end generation: EOS, EOT/EOM and end-of-turn tokens found by name."""
    special_token_ids: frozenset[int]
    """Control/unknown tokens: matched whole in text, dropped by skip_special_tokens."""


class Tokenizer:
    """Encode and decode one model's text. Thread-safe; build with `Tokenizer.from_gguf`."""

    def __init__(self, backend: tokenizers.Tokenizer, tokens: Sequence[str],
                 special: SpecialTokens) -> None:
        self._backend = backend
        self._tokens = tokens
        self.special = special
        self._plain_backend: tokenizers.Tokenizer | None = None  # special tokens as plain text
        self._plain_lock = threading.Lock()

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        model, tokens, token_types = _vocabulary(gguf_file)
        if model == "gpt2":
            backend = _build_byte_level(gguf_file, tokens, token_types)
        elif model == "llama":
            backend = _build_sentencepiece(gguf_file, tokens, token_types)
        else:
            raise ValueError(f"{gguf_file.path}: unsupported tokenizer model {model!r} "
                             "(supported: 'gpt2', 'llama')")
        special = _read_special_tokens(gguf_file, model, tokens, token_types)
        _set_post_processor(backend, special, tokens)
        return cls(backend, tokens, special)

    def to_json(self) -> str:
        """The tokenizers JSON document (structured outputs build their vocabulary from it)."""
        return self._backend.to_str()

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self.special.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.special.eos_token_id

    @property
    def eog_token_ids(self) -> frozenset[int]:
        return self.special.eog_token_ids

    @property
    def bos_token(self) -> str:
        """BOS as text ('' when the model has none), for chat templates."""
        return self._text_of(self.special.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._text_of(self.special.eos_token_id)

    @property
    def template_tokens(self) -> dict[str, str]:
        """bos_token / eos_token / unk_token / pad_token as text, for chat templates."""
        ids = {"bos_token": self.special.bos_token_id, "eos_token": self.special.eos_token_id,
               "unk_token": self.special.unk_token_id, "pad_token": self.special.pad_token_id}
        return {name: self._tokens[i] for name, i in ids.items() if i is not None}

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled as stored (e.g. 'Ġthe', '▁the', '<|im_end|>')."""
        return self._token_ids.get(token)

    @functools.cached_property
    def _token_ids(self) -> dict[str, int]:
        """Spelling -> id, built on first use (a second for a 262k vocabulary)."""
        return self._backend.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        self._check_ids([token_id])
        return self._tokens[token_id]

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True,
               allow_special: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens: BOS/EOS as the file asks.
        allow_special: control tokens written in the text (`<|im_start|>`) become their ids;
        False tokenizes them as plain text (for untrusted text)."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        backend = self._backend if allow_special else self._plain()
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str],
                     add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text (special-token text allowed), in parallel threads."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; invalid UTF-8 byte runs come out as U+FFFD."""
        ids = list(token_ids)
        self._check_ids(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        size = len(self._tokens)
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) \
                    or not 0 <= token_id < size:
                raise ValueError(f"token id {token_id!r} is not in the vocabulary [0, {size})")

    def _plain(self) -> tokenizers.Tokenizer:
        """A twin backend that reads special-token text as plain text; built on first use."""
        with self._plain_lock:
            if self._plain_backend is None:
                plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain_backend = plain
            return self._plain_backend


def read_special_tokens(gguf_file: GGUFFile) -> SpecialTokens:
    """The file's special tokens (end-of-generation ids included) as Tokenizer.from_gguf reads
    them, without building the tokenizer: for processes that need only when to stop."""
    model, tokens, token_types = _vocabulary(gguf_file)
    return _read_special_tokens(gguf_file, model, tokens, token_types)


def _vocabulary(gguf_file: GGUFFile) -> tuple[str, list[str], list[int]]:
    """(tokenizer.ggml.model, tokens, token types), checked to be present and to agree."""
    model = gguf_file.get("tokenizer.ggml.model")
    tokens = gguf_file.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ValueError(f"{gguf_file.path}: no tokenizer in the GGUF metadata "
                         "(tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    token_types = list(gguf_file.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(f"{gguf_file.path}: {len(token_types)} token types for "
                         f"{len(tokens)} tokens")
    return str(model), list(tokens), token_types


# -- building the backend ---------------------------------------------------------------------

def resolve_pre_tokenizer(name: str | None) -> str:
    """The split family for a `tokenizer.ggml.pre` value; unknown names are refused, since a wrong
    split silently changes every prompt's tokens."""
    if not name:
        logger.warning("GGUF names no tokenizer.ggml.pre; using llama.cpp's 'default' split")
        return "default"
    family = PRE_TOKENIZER_ALIASES.get(name)
    if family is None:
        raise ValueError(f"unsupported tokenizer.ggml.pre {name!r}; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZER_ALIASES))}")
    return family


def _byte_level_pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        for pattern in PRE_TOKENIZER_SPLITS[family]]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(splits)


def _build_byte_level(gguf_file: GGUFFile, tokens: list[str],
                      token_types: list[int]) -> tokenizers.Tokenizer:
    family = resolve_pre_tokenizer(gguf_file.get("tokenizer.ggml.pre"))
    merges = gguf_file.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"{gguf_file.path}: gpt2 tokenizer without tokenizer.ggml.merges")
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    spelled = [t if alphabet.issuperset(t) else _byte_spelling(t) for t in tokens]
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(spelled)},
        merges=[_split_merge(m) for m in merges],
        ignore_merges=family in IGNORE_MERGES_FAMILIES))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(family)
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel llama.cpp files carry;
    # it stays an ordinary (respelled) vocabulary entry.
    _add_special_tokens(backend, tokens, token_types, lambda t: alphabet.issuperset(t))
    return backend


def _byte_spelling(text: str) -> str:
    """`text` in GPT-2's byte alphabet (one printable char per UTF-8 byte)."""
    byte_chars = _BYTE_CHARS
    return "".join(byte_chars[b] for b in text.encode("utf-8"))


def _gpt2_byte_chars() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = [""] * 256
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = _gpt2_byte_chars()


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"malformed tokenizer.ggml.merges entry {merge!r} (want 'left right')")
    return left, right


def _build_sentencepiece(gguf_file: GGUFFile, tokens: list[str],
                         token_types: list[int]) -> tokenizers.Tokenizer:
    scores = gguf_file.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"{gguf_file.path}: llama tokenizer needs one tokenizer.ggml.scores "
                         f"entry per token ({len(tokens)})")
    vocab = {token: i for i, token in enumerate(tokens)}
    has_bytes = TOKEN_BYTE in token_types
    unk_id = gguf_file.get("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=sentencepiece_merges(tokens, scores), fuse_unk=True,
        byte_fallback=has_bytes,
        unk_token=None if has_bytes or unk_id is None else tokens[int(unk_id)]))
    # llama.cpp's rule (and SentencePiece's dummy prefix): every run of text between matched
    # special tokens gets a leading space, even one that already starts with a space. (HF's
    # GGUF converter uses Metaspace 'first', which skips both cases and breaks round-trips.)
    add_space_prefix = bool(gguf_file.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decode_steps)
    _add_special_tokens(backend, tokens, token_types, lambda t: True)
    return backend


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule (merge the adjacent pair whose union is the
    best-scored token): every split of every token into two tokens, best union score first."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int]] = []
    for token_id, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left_id, right_id = ids.get(token[:cut]), ids.get(token[cut:])
            if left_id is not None and right_id is not None:
                # Sort key: score desc, then longer left piece, then vocabulary order.
                ranked.append((-float(scores[token_id]), -cut, -(len(token) - cut),
                               left_id, right_id))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, _, _, left, right in ranked]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str],
                        token_types: Sequence[int], is_spellable: Any) -> None:
    """Control/unknown tokens become special added tokens, user-defined ones plain added tokens:
    both are matched whole in text, never split by BPE."""
    special, user = [], []
    for token, token_type in zip(tokens, token_types):
        if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN) and token and is_spellable(token):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_USER_DEFINED and token:
            user.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _read_special_tokens(gguf_file: GGUFFile, model: str, tokens: Sequence[str],
                         token_types: Sequence[int]) -> SpecialTokens:
    def token_id(key: str) -> int | None:
        value = gguf_file.get(f"tokenizer.ggml.{key}")
        if value is None or not 0 <= int(value) < len(tokens):
            return None  # absent, or -1 / out-of-range placeholders some converters write
        return int(value)

    pre = gguf_file.get("tokenizer.ggml.pre")
    default_bos = model == "llama" or PRE_TOKENIZER_ALIASES.get(pre or "") in ADD_BOS_FAMILIES
    eos_id = token_id("eos_token_id")
    eog = {i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
    eog.update(i for i, t in enumerate(tokens) if t in END_OF_GENERATION_NAMES)
    return SpecialTokens(
        bos_token_id=token_id("bos_token_id"), eos_token_id=eos_id,
        unk_token_id=token_id("unknown_token_id"), pad_token_id=token_id("padding_token_id"),
        add_bos_token=bool(gguf_file.get("tokenizer.ggml.add_bos_token", default_bos)),
        add_eos_token=bool(gguf_file.get("tokenizer.ggml.add_eos_token", False)),
        eog_token_ids=frozenset(eog),
        special_token_ids=frozenset(i for i, t in enumerate(token_types)
                                    if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)))


def _set_post_processor(backend: tokenizers.Tokenizer, special: SpecialTokens,
                        tokens: Sequence[str]) -> None:
    """BOS/EOS added by encode(add_special_tokens=True), as the file's add_*_token flags say."""
    head, tail = [], []
    if special.add_bos_token and special.bos_token_id is not None:
        head = [(tokens[special.bos_token_id], special.bos_token_id)]
    if special.add_eos_token and special.eos_token_id is not None:
        tail = [(tokens[special.eos_token_id], special.eos_token_id)]
    if not head and not tail:
        backend.post_processor = None
        return
    single = [name for name, _ in head] + ["$A"] + [name for name, _ in tail]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=single + ["$B:1"], special_tokens=list(dict(head + tail).items()))
