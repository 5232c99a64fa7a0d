"""Sampling parameters of one request: validated once, at the edge, then trusted; and the
server's defaults for the fields a request leaves out (config, else the model's, else
llama-server's).

Owns: the parameter set, its validation (ValueError naming the bad value) and the defaults'
precedence. Does not own: the sampler (workers/sampler.py), OpenAI field mapping (frontend) or
reading the model's defaults from its GGUF (justapi/model/info.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from justapi.wire.codec import register

MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
"""Most tokens one request may bias."""
MAX_BIAS = 100.0
"""|bias| limit (OpenAI's): -100 in effect bans a token, +100 all but forces it."""
MAX_INT32 = 2**31 - 1  # token ids and counts travel as int32
BUILTIN_SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
"""llama-server's defaults: what a request that leaves a field out gets when neither the
server's config nor the model's GGUF names one. The fields listed here are the defaulted ones."""
SOURCE_CONFIG, SOURCE_GGUF, SOURCE_BUILTIN = "config", "gguf", "builtin"
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
"""What a StructuredOutput's spec is (see StructuredOutput.spec)."""
JSON_WHITESPACE = ("spaced", "compact", "flexible")
"""Whitespace a JSON constraint allows: `{"a": 1, "b": [1, 2]}` (spaced: one line, the separators
of json.dumps), `{"a":1,"b":[1,2]}` (compact), or between tokens either nothing, one space, or
one or two newlines and at most 20 spaces/tabs (flexible: llama.cpp's bound)."""
MAX_STRUCTURED_SPEC_CHARS = 1 << 20
"""Longest schema / grammar text a request may carry."""
MAX_REASONING_MARKER_CHARS = 64
"""Longest reasoning marker (`<think>`, `</think>`) a constraint may start after."""


@register("StructuredOutput")
@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text (structured outputs), checked structurally here; the
    grammar itself is checked by justapi.structured.check_structured (the frontend's job) and
    compiled in the scheduler (justapi/structured/). Docs: docs/structured-outputs.md."""

    kind: str
    """One of STRUCTURED_KINDS."""
    spec: str = ""
    """json_schema: the schema as JSON text; json_object: "" (any JSON object); regex: the
    pattern (Rust regex syntax, matched against the whole output); choice: a JSON list of the
    allowed strings; lark: llguidance's Lark dialect (%json <schema>, [lazy] rules, special tokens
    as <|name|>); gbnf: a GBNF (llama.cpp) or EBNF grammar, converted to Lark (Lark passes)."""
    whitespace: str = "spaced"
    """JSON kinds only: one of JSON_WHITESPACE. A schema's own "x-guidance" options (llguidance's
    JSON options, e.g. coerce_one_of) override it."""
    reasoning_end: str = ""
    """A reasoning model's end of thinking: its text (`</think>`), or `<[id]>` when it is one
    token of the vocabulary. The output is free up to it, then whitespace, then the
    constrained answer. "": constrained from the start."""
    reasoning_start: str = ""
    """With reasoning_end: the start of thinking, written the same way; the output may open
    its thinking with it or answer at once. "": the output starts inside its thinking (the
    prompt opened it)."""

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS,
               f"structured output kind must be one of {list(STRUCTURED_KINDS)}, got {self.kind!r}")
        _check(isinstance(self.spec, str), f"structured output spec must be a string, got "
                                           f"{type(self.spec).__name__}")
        _check(len(self.spec) <= MAX_STRUCTURED_SPEC_CHARS,
               f"structured output spec has {len(self.spec)} characters, the limit is "
               f"{MAX_STRUCTURED_SPEC_CHARS}")
        _check(bool(self.spec) != (self.kind == "json_object"),
               "a json_object constraint takes no spec" if self.kind == "json_object"
               else f"a {self.kind} constraint needs a spec")
        _check(self.whitespace in JSON_WHITESPACE,
               f"structured output whitespace must be one of {list(JSON_WHITESPACE)}, got "
               f"{self.whitespace!r}")
        for name in ("reasoning_end", "reasoning_start"):
            marker = getattr(self, name)
            _check(isinstance(marker, str) and len(marker) <= MAX_REASONING_MARKER_CHARS,
                   f"structured output {name} must be a string of at most "
                   f"{MAX_REASONING_MARKER_CHARS} characters")
        _check(bool(self.reasoning_end) or not self.reasoning_start,
               "structured output reasoning_start needs reasoning_end")

    @property
    def key(self) -> tuple[str, ...]:
        """What its compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.spec, self.whitespace, self.reasoning_end, self.reasoning_start)


@register("SamplingParams")
@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. The class defaults are the OpenAI API's
    (T=1, no truncation); the frontend gives the fields a request leaves out the server's
    defaults (SamplingDefaults) before it builds one."""

    max_tokens: int = 16
    """Most tokens to generate (the prompt is not counted)."""
    temperature: float = 1.0
    """0 means greedy (argmax); otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    repetition_penalty: float = 1.0
    """CTRL-style: logits of tokens seen in prompt or output are divided (if >0) or multiplied by it."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token that appears in the output so far."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output so far."""
    seed: int | None = None
    """Per-request seed: same seed and prompt give the same tokens whatever else is batched."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (the stop token is part of the output)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: int | None = None
    """None: no logprobs; n >= 0: the sampled token's logprob plus the top n alternatives."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, sorted by id: the bias is added to the token's logit before
    penalties and sampling, greedy included (logprobs stay the model's own). A dict
    {id: bias} is accepted too."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (None: free text). The
    request finishes with "stop" when the grammar is complete."""

    def __post_init__(self) -> None:
        if isinstance(self.structured, dict):  # to_dict() / JSON
            object.__setattr__(self, "structured", _structured_from(self.structured))
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if not isinstance(self.stop_token_ids, tuple):  # lists arrive from JSON
            _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids must be a list")
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        _check(isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= MAX_INT32,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be in [0, 100], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_INT32,
               f"top_k must be an integer in [-1, 2**31) (0 or -1 disables), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0,
                   f"{name} must be in [-2, 2], got {value!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
               and all(isinstance(t, int) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
               f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids (integers in "
               f"[0, 2**31))")
        _check(self.logprobs is None
               or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return out  # structured: a dict (asdict), which __post_init__ turns back

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class SamplingDefault:
    name: str
    """A SamplingParams field name (one of BUILTIN_SAMPLING_DEFAULTS)."""
    value: float
    source: str
    """Where the value comes from: SOURCE_CONFIG (a flag or TOML key), SOURCE_GGUF (the model's
    general.sampling.* metadata) or SOURCE_BUILTIN (llama-server's)."""


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling defaults in force on a server, one per defaulted field."""

    entries: tuple[SamplingDefault, ...]

    @classmethod
    def resolve(cls, configured: Mapping[str, float] | None = None,
                from_model: Mapping[str, float] | None = None) -> SamplingDefaults:
        """Per field: the configured value, else the model's, else the builtin one."""
        configured, from_model = configured or {}, from_model or {}
        entries = []
        for name, builtin in BUILTIN_SAMPLING_DEFAULTS.items():
            if name in configured:
                entries.append(SamplingDefault(name, configured[name], SOURCE_CONFIG))
            elif name in from_model:
                entries.append(SamplingDefault(name, from_model[name], SOURCE_GGUF))
            else:
                entries.append(SamplingDefault(name, builtin, SOURCE_BUILTIN))
        return cls(tuple(entries))

    @property
    def values(self) -> dict[str, float]:
        return {entry.name: entry.value for entry in self.entries}

    @property
    def sources(self) -> dict[str, str]:
        return {entry.name: entry.source for entry in self.entries}

    def fill(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments, plus a default for each defaulted field they lack."""
        return {**self.values, **fields}

    def apply(self, sampling: SamplingParams, unset: Iterable[str]) -> SamplingParams:
        """`sampling` with the fields named in `unset` (those its client left out) set to the
        defaults; names without a default keep the value sent."""
        values = self.values
        changes: dict[str, Any] = {name: values[name] for name in unset if name in values}
        return dataclasses.replace(sampling, **changes) if changes else sampling

    def describe(self) -> str:
        """'temperature 0.8 (builtin), top-k 40 (builtin), ...' for logs and the banner."""
        return ", ".join(f"{entry.name.replace('_', '-')} {entry.value:g} ({entry.source})"
                         for entry in self.entries)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """{id: bias} or [[id, bias], ...] -> validated pairs sorted by token id."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    _check(len(items) <= MAX_LOGIT_BIAS,
           f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases, got {len(items)}")
    pairs = []
    for item in items:
        _check(isinstance(item, (list, tuple)) and len(item) == 2,
               f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        token_id, bias = item
        _check(isinstance(token_id, int) and not isinstance(token_id, bool)
               and 0 <= token_id <= MAX_INT32,
               f"logit_bias token ids must be integers in [0, 2**31), got {token_id!r}")
        _check(_is_number(bias) and -MAX_BIAS <= bias <= MAX_BIAS,
               f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias!r}")
        pairs.append((token_id, float(bias)))
    pairs.sort()
    _check(len({token_id for token_id, _ in pairs}) == len(pairs),
           "logit_bias names a token id twice")
    return tuple(pairs)


def _structured_from(data: dict[str, Any]) -> StructuredOutput:
    known = {f.name for f in dataclasses.fields(StructuredOutput)}
    _check(set(data) <= known, f"unknown structured output field(s): {sorted(set(data) - known)}")
    return StructuredOutput(**data)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
