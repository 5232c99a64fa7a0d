"""Structured outputs in tests: a small JSON-friendly vocabulary for the simulator's fake model
(vocab 128, EOS = 1 as the sim harness's), the core's StructuredOutputs over it, and the
reference every schedule must reproduce: plain constrained greedy decoding, one token a step.
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance as llg
import llguidance.numpy as lnp
import numpy as np

from justapi.sampling import StructuredOutput
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.sim.fake_model import ReferenceModel, allowed_ids
from justapi.scheduler.structured import StructuredOutputs
from justapi.structured.compiler import GrammarCompiler
from justapi.structured.grammar import grammar_text
from justapi.structured.tokenizer import TokenList, mask_words

SIM_VOCAB = 128
SIM_EOS = 1
_MULTI = [b'{"', b'":', b'": ', b'", "', b'"}', b'", ', b', "', b"true", b"false", b"null",
          b"name", b"age", b"tags", b"id", b"ok", b"}]", b"]}", b"00"]


def sim_token_list() -> TokenList:
    """ids 0 and 1: a NUL byte and EOS; then printable ASCII and newline; then a few
    multi-byte pieces (so forced spans tokenize into fewer tokens than bytes); ids past the
    list up to SIM_VOCAB are padding the grammar never allows."""
    tokens = [b"\x00", b"<eos>"] + [bytes([c]) for c in range(32, 127)] + [b"\n"] + _MULTI
    assert len(tokens) <= SIM_VOCAB
    return TokenList(tokens, SIM_EOS)


def sim_structured(**options: object) -> StructuredOutputs:
    tokens = sim_token_list()
    return StructuredOutputs(GrammarCompiler(tokens.ll_tokenizer), (SIM_EOS,), **options)  # type: ignore[arg-type]


def with_structured(core: Scheduler, **options: object) -> Scheduler:
    core.state.structured = sim_structured(**options)
    return core


def reference_constrained(prompt: Sequence[int], structured: StructuredOutput, max_tokens: int,
                          tokenizer: llg.LLTokenizer,
                          vocab_size: int = SIM_VOCAB) -> tuple[list[int], str]:
    """The fake model's constrained greedy output: each token picked among the ids the mask
    allows; "stop" when the grammar completes (or EOS), "length" at max_tokens."""
    model = ReferenceModel(vocab_size)
    matcher = llg.LLMatcher(tokenizer, grammar_text(structured), log_level=0)
    mask = np.zeros((1, mask_words(tokenizer.vocab_size)), dtype=np.int32)
    tokens, out = [int(t) for t in prompt], []
    while len(out) < max_tokens:
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        token = model.next_token(tokens, allowed_ids(mask[0], vocab_size))
        tokens.append(token)
        out.append(token)
        assert matcher.consume_token(token), matcher.get_error()
        if matcher.is_stopped():
            return out, "stop"
    return out, "length"


def text_of(token_ids: Sequence[int]) -> str:
    tokens = sim_token_list().tokens
    return b"".join(tokens[t] for t in token_ids if t != SIM_EOS).decode()
