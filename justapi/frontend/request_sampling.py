"""An API request's sampling fields -> SamplingParams, stop strings and TextOptions.

Maps OpenAI fields onto SamplingParams (fields a request leaves out take the server's sampling
defaults; logit_bias keys parsed, biased tokens checked against the vocabulary), derives distinct per-choice seeds for n > 1 and checks stop strings. Owns:
that mapping. Does not own: what SamplingParams accepts (justapi/sampling.py), prompts.
"""
from __future__ import annotations

from justapi.frontend.errors import ApiError, sampling_error
from justapi.frontend.generation import TextOptions
from justapi.frontend.openai_models import GenerationFields
from justapi.frontend.prompts import check_token_ids
from justapi.frontend.text.detokenizer import StopStringMatcher
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.sampling import SamplingDefaults, SamplingParams, StructuredOutput

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty")
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, choice_index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 reproduces it); choice i > 0 gets a splitmix64
    mix of (seed, i): deterministic, distinct in practice, in [0, 2**63)."""
    if choice_index == 0:
        return seed
    z = (seed + choice_index * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class SamplingRules:
    """Sampling as this model allows it (its vocabulary, its end-of-generation tokens)."""

    def __init__(self, tokenizer: Tokenizer, defaults: SamplingDefaults | None = None) -> None:
        self.tokenizer = tokenizer
        self.defaults = defaults or SamplingDefaults.resolve()

    def sampling_for(self, request: GenerationFields, max_tokens: int, logprobs: int | None,
                     seed: int | None, *,
                     structured: StructuredOutput | None = None) -> SamplingParams:
        fields: dict = {"max_tokens": max_tokens, "seed": seed, "logprobs": logprobs,
                        "ignore_eos": request.ignore_eos, "structured": structured,
                        "stop_token_ids": tuple(request.stop_token_ids or ()),
                        "logit_bias": _bias_by_id(request.logit_bias or {})}
        for name in SAMPLING_FIELDS:
            value = getattr(request, name)
            if value is not None:
                fields[name] = value
        try:
            sampling = SamplingParams(**self.defaults.fill(fields))
        except ValueError as exc:
            raise sampling_error(exc, (*SAMPLING_FIELDS, "seed", "stop_token_ids",
                                       "max_tokens", "logprobs", "logit_bias")) from None
        return self.check_sampling(sampling)

    def check_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """What SamplingParams cannot know: the biased tokens are in this model's vocabulary."""
        check_token_ids([token_id for token_id, _ in sampling.logit_bias],
                        self.tokenizer.vocab_size, "logit_bias")
        return sampling

    def stop_strings(self, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if stops:
            try:
                StopStringMatcher(stops)  # the matcher's own limits: count, length, non-empty
            except ValueError as exc:
                raise ApiError(str(exc), param="stop") from None
        return tuple(stops)

    def text_options(self, sampling: SamplingParams, stop: tuple[str, ...],
                     show_special_tokens: bool = False) -> TextOptions:
        hidden = frozenset(self.tokenizer.eog_token_ids) | frozenset(sampling.stop_token_ids)
        return TextOptions(stop=stop, hidden_token_ids=hidden,
                           skip_special_tokens=not show_special_tokens,
                           with_logprobs=sampling.logprobs is not None)


def _bias_by_id(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings ("50256")."""
    out = {}
    for key, bias in logit_bias.items():
        digits = key.strip()
        if not (digits.isascii() and digits.isdigit()):
            raise ApiError(f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                           param="logit_bias")
        out[int(digits)] = bias
    return out
