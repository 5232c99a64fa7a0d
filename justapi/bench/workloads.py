"""Seeded benchmark workloads for `justapi bench serve`: prompts, output lengths, arrival times.

Owns: deterministic pseudo-text from word lists, prompt sizing (a tokens-per-word estimate,
or exact sizing with a GGUF's tokenizer), the workload shapes and Poisson arrivals (multi-turn
conversations: conversations.py).
Does not own: HTTP, timing or statistics (client.py, report.py).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

WORKLOADS = ("batch", "shared-prefix", "single", "mixed", "long-burst", "copy", "multi-turn")
COPY_PROMPT = "Repeat the following passage word for word:\n\n{}\n"
LENGTH_DISTRIBUTIONS = ("uniform", "log-uniform")
"""mixed: how output lengths spread over 16..N. log-uniform is long-tailed like real chat
outputs (most short, a few long): a static batch then waits on its longest member longer."""

# Common English words: nearly all are one token (with their leading space) in the BPE
# vocabularies of llama-family models. Measured on SmolLM2's tokenizer, text made from
# this list costs ~1.1 tokens per word (sentence punctuation included).
WORDS = tuple("""
the of and to in is was for on that with as by at from his her they this which are
have had not be one all were when there can an your their said each she do how will up
other about out many then them these so some would make like him into time has look two
more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work
know place year live me back give most very after thing our just name good sentence man
think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large
must big even such because turn here why ask went men read need land different home us
move try kind hand picture again change off play spell air away animal house point page
letter mother answer found study still learn should world high every near add food
between own below country plant last school father keep tree never start city earth eye
light thought head under story saw left few while along might close something seem next
hard open example begin life always those both paper together got group often run
important until children side feet car mile night walk white sea began grow took river
four carry state once book hear stop without second later miss idea enough eat face
watch far real almost let above girl sometimes mountain cut young talk soon list song
being leave family garden window bridge market winter summer morning evening
""".split())
TOKENS_PER_WORD = 1.1
SENTENCE_WORDS = (6, 14)  # a sentence has this many words (inclusive range)


class PromptSizer(Protocol):
    """Turns a word stream into a prompt of about `num_tokens` tokens."""

    def make_text(self, rng: random.Random, num_tokens: int) -> str: ...


def pseudo_text(rng: random.Random, num_words: int) -> str:
    """`num_words` seeded words grouped into capitalised sentences ending with '.'."""
    if num_words < 0:
        raise ValueError(f"num_words must be >= 0, got {num_words}")
    sentences: list[str] = []
    remaining = num_words
    while remaining > 0:
        length = min(remaining, rng.randint(*SENTENCE_WORDS))
        words = [rng.choice(WORDS) for _ in range(length)]
        sentences.append(" ".join(words).capitalize() + ".")
        remaining -= length
    return " ".join(sentences)


class TextTokenizer(Protocol):
    """What TokenizerSizer needs of a tokenizer (justapi.frontend.text.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class EstimateSizer:
    """Sizes prompts by TOKENS_PER_WORD: cheap, needs no tokenizer, within ~10%."""

    def make_text(self, rng: random.Random, num_tokens: int) -> str:
        return pseudo_text(rng, max(1, round(num_tokens / TOKENS_PER_WORD)))


class TokenizerSizer:
    """Sizes prompts exactly with a tokenizer: the text is the decode of the first
    `num_tokens` ids of a longer pseudo-text (re-encoding may differ by a token at the cut)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def make_text(self, rng: random.Random, num_tokens: int) -> str:
        num_words = max(8, round(num_tokens / TOKENS_PER_WORD * 1.3))
        token_ids = self._encode(pseudo_text(rng, num_words))
        while len(token_ids) < num_tokens:  # the estimate was short: add a sentence
            token_ids += self._encode(" " + pseudo_text(rng, SENTENCE_WORDS[1]))
        return self.tokenizer.decode(token_ids[:num_tokens])

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer_sizer(gguf_path: str) -> TokenizerSizer:
    """A TokenizerSizer over the tokenizer stored in a GGUF (justapi.frontend.text.tokenizer)."""
    from justapi.frontend.text.tokenizer import Tokenizer  # only with --tokenizer-gguf
    from justapi.model.gguf_file import GGUFFile

    return TokenizerSizer(Tokenizer.from_gguf(GGUFFile(gguf_path)))


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt, output budget, group and optional fixed launch time."""

    index: int
    prompt: str
    prompt_tokens: int
    """Target prompt size in tokens (what the sizer aimed for)."""
    max_tokens: int
    group: str = "main"
    """Requests are summarised per group too (long-burst: 'decode' and 'burst')."""
    arrival_s: float | None = None
    """Launch offset from the start of the run; None: as the launcher decides."""


@dataclass(frozen=True)
class WorkloadOptions:
    """Knobs of a workload; None means the workload's own default."""

    name: str = "batch"
    num_requests: int = 64
    seed: int = 0
    max_tokens: int | None = None
    """Output tokens per request (mixed: the upper bound of the range)."""
    prompt_tokens: int | None = None
    """Prompt size (shared-prefix: the prefix; long-burst: the burst prompts)."""
    decode_streams: int = 8
    """long-burst: streams that decode from t=0 while the bursts arrive."""
    burst_size: int = 4
    """long-burst: long prompts arriving together."""
    burst_interval_s: float = 2.0
    """long-burst: time between bursts (the first one comes after half of it)."""
    length_dist: str = "uniform"
    """mixed: one of LENGTH_DISTRIBUTIONS."""
    turns: int = 4
    """multi-turn: turns per conversation (num_requests counts conversations)."""

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose one of {WORKLOADS}")
        if self.length_dist not in LENGTH_DISTRIBUTIONS:
            raise ValueError(f"unknown length distribution {self.length_dist!r}; choose one "
                             f"of {LENGTH_DISTRIBUTIONS}")
        for field in ("num_requests", "decode_streams", "burst_size", "turns"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        for field in ("max_tokens", "prompt_tokens"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.burst_interval_s <= 0:
            raise ValueError(f"burst_interval_s must be > 0, got {self.burst_interval_s}")
        if self.name == "long-burst" and self.num_requests <= self.decode_streams:
            raise ValueError(f"long-burst needs num_requests ({self.num_requests}) > "
                             f"decode_streams ({self.decode_streams}) to leave burst requests")


def build_workload(options: WorkloadOptions, sizer: PromptSizer) -> list[BenchRequest]:
    """The requests of `options.name`, identical for identical options and seed."""
    rng = random.Random(options.seed)
    builders = {"batch": _uniform, "single": _uniform, "shared-prefix": _shared_prefix,
                "mixed": _mixed, "long-burst": _long_burst, "copy": _copy}
    if options.name == "multi-turn":
        raise ValueError("multi-turn builds conversations (conversations.py), not requests")
    return builders[options.name](options, sizer, rng)


def _uniform(options: WorkloadOptions, sizer: PromptSizer,
             rng: random.Random) -> list[BenchRequest]:
    prompt_tokens = options.prompt_tokens or 128
    max_tokens = options.max_tokens or 128
    return [BenchRequest(i, sizer.make_text(rng, prompt_tokens), prompt_tokens, max_tokens)
            for i in range(options.num_requests)]


def _shared_prefix(options: WorkloadOptions, sizer: PromptSizer,
                   rng: random.Random) -> list[BenchRequest]:
    prefix_tokens = options.prompt_tokens or 512
    question_tokens = 16
    max_tokens = options.max_tokens or 64
    prefix = sizer.make_text(rng, prefix_tokens)
    requests = []
    for i in range(options.num_requests):
        question = sizer.make_text(rng, question_tokens).rstrip(".")
        prompt = f"{prefix}\n\nQuestion {i}: {question}?\nAnswer:"
        requests.append(BenchRequest(i, prompt, prefix_tokens + question_tokens + 8, max_tokens))
    return requests


def _mixed(options: WorkloadOptions, sizer: PromptSizer,
           rng: random.Random) -> list[BenchRequest]:
    prompt_tokens = options.prompt_tokens or 128
    upper = options.max_tokens or 256
    lower = min(16, upper)
    requests = []
    for i in range(options.num_requests):
        prompt = sizer.make_text(rng, prompt_tokens)
        if options.length_dist == "log-uniform":
            length = round(math.exp(rng.uniform(math.log(lower), math.log(upper))))
        else:
            length = rng.randint(lower, upper)
        requests.append(BenchRequest(i, prompt, prompt_tokens, min(upper, max(lower, length))))
    return requests


def _long_burst(options: WorkloadOptions, sizer: PromptSizer,
                rng: random.Random) -> list[BenchRequest]:
    """Decode streams start at t=0; bursts of long prompts (short outputs) arrive every
    burst_interval_s from burst_interval_s / 2 on, while the streams are decoding."""
    decode_max_tokens = options.max_tokens or 256
    burst_tokens = options.prompt_tokens or 1500
    requests = [BenchRequest(i, sizer.make_text(rng, 128), 128, decode_max_tokens,
                             group="decode", arrival_s=0.0)
                for i in range(options.decode_streams)]
    for j in range(options.num_requests - options.decode_streams):
        arrival_s = options.burst_interval_s * (0.5 + j // options.burst_size)
        requests.append(BenchRequest(len(requests), sizer.make_text(rng, burst_tokens),
                                     burst_tokens, 16, group="burst", arrival_s=arrival_s))
    return requests


def _copy(options: WorkloadOptions, sizer: PromptSizer,
          rng: random.Random) -> list[BenchRequest]:
    """Input-grounded: each prompt holds a passage (~300 tokens) and asks for it back."""
    passage_tokens = options.prompt_tokens or 300
    max_tokens = options.max_tokens or passage_tokens
    return [BenchRequest(i, COPY_PROMPT.format(sizer.make_text(rng, passage_tokens)),
                         passage_tokens + 12, max_tokens) for i in range(options.num_requests)]


def poisson_arrivals(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Launch offsets (seconds) of a Poisson process of `request_rate` requests/s; the
    first request starts at 0."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    rng = random.Random(seed + 1_000_003)  # independent of the prompt stream of `seed`
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets
