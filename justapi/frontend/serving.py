"""From a validated API request to running Generations: prompts, limits, sampling, fan-out.

Shared by the OpenAI routes (serving_completions.py, serving_chat.py) and the ZMQ endpoint:
tokenizes prompts (the scheduler sees only ids), renders chat messages with the model's
template, checks the model name and the context length, maps OpenAI fields onto
SamplingParams (fields a request leaves out take the server's sampling defaults; distinct
per-choice seeds are derived for n > 1), submits one scheduler
request per choice, and fans their outputs back in. Owns: the serving settings and request
ids. Does not own: response shapes, text state (generation.py), the scheduler link.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import orjson

from justapi.frontend.admission import Admission, RejectionCounter, unavailable
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.errors import NOT_FOUND, SERVER_ERROR, ApiError, sampling_error
from justapi.frontend.generation import Generation, GenerationOutput, TextOptions
from justapi.frontend.metrics import FrontendMetrics
from justapi.frontend.openai_models import GenerationFields
from justapi.frontend.text.detokenizer import StopStringMatcher
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.sampling import SamplingDefaults, SamplingParams
from justapi.wire.protocol import FINISH_ERROR, SubmitRequest

logger = logging.getLogger(__name__)

ChatRenderer = Callable[[list[dict], bool], str]
"""(messages, add_generation_prompt) -> prompt text; raises ValueError for bad messages."""
MAX_CHOICES = 64  # prompts x n of one request
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty")
SSE_DONE = b"data: [DONE]\n\n"
LOGGED_PROMPT_CHARS = 2000  # --log-requests: longer prompts are cut in the log
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ServingConfig:
    model_name: str
    """The id clients name in `model` (and /v1/models lists)."""
    max_context: int
    """Prompt + generated tokens of one request."""
    model_aliases: tuple[str, ...] = ()
    """Other names `model` may give for the same model (the GGUF's general.name, its file name
    and path, as vLLM and llama-server users tend to write them)."""
    cache_salt: str = ""
    """Prefix-cache namespace sent with every request."""
    max_in_flight: int = 0
    """Most scheduler requests in flight at once (running + queued); past it 429. 0: no bound."""
    log_requests: bool = False
    """Log each request's prompt and parameters (off: prompts never reach the logs)."""
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults.resolve)
    """What the sampling fields a request leaves out get (default: llama-server's)."""


def derive_seed(seed: int, choice_index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 reproduces it); choice i > 0 gets a splitmix64
    mix of (seed, i): deterministic, distinct in practice, in [0, 2**63)."""
    if choice_index == 0:
        return seed
    z = (seed + choice_index * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None
    """The prompt as text when the client sent text (for echo)."""


class Serving:
    """Everything a request handler needs; one per frontend process."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, render_chat: ChatRenderer,
                 config: ServingConfig, metrics: FrontendMetrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.render_chat = render_chat
        self.config = config
        self.metrics = metrics
        self._id_prefix = os.urandom(4).hex()
        self._next_id = 0
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary
        self.admission = Admission(engine, config.max_in_flight,
                                   RejectionCounter(metrics.registry, config.model_name))

    def new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{kind}-{self._id_prefix}{self._next_id:x}"

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens spelled out), as logprobs show it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # ---------------------------------------------------------------- checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name \
                and model not in self.config.model_aliases:
            raise ApiError(f"model {model!r} is not served here (this server serves "
                           f"{self.config.model_name!r})", param="model", code="model_not_found",
                           status=404, error_type=NOT_FOUND)

    def check_available(self, num_requests: int = 1) -> None:
        """503 (draining, scheduler lost) or 429 (queue full) unless the requests may start."""
        self.admission.check(num_requests)

    def generation_failed(self, error: str | None) -> ApiError:
        """A request the engine failed: 503 when the scheduler is gone (retry elsewhere), 500
        otherwise."""
        if self.engine.scheduler_lost:
            return unavailable(f"generation failed: {error}")
        return ApiError(f"generation failed: {error}", status=500, error_type=SERVER_ERROR)

    def log_request(self, kind: str, prompts: Sequence[Prompt], sampling: SamplingParams) -> None:
        """With --log-requests only: prompts are user data and stay out of the logs otherwise."""
        if not self.config.log_requests:
            return
        for prompt in prompts:
            text = prompt.text if prompt.text is not None else str(prompt.token_ids)
            logger.info("%s request: prompt (%d tokens) %r, %s", kind, len(prompt.token_ids),
                        text[:LOGGED_PROMPT_CHARS], sampling)

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> list[int]:
        ids = list(token_ids)
        if ids:
            try:
                array = np.asarray(ids, dtype=np.int64)
                is_valid = int(array.min()) >= 0 and int(array.max()) < self.tokenizer.vocab_size
            except OverflowError:  # JSON integers have no size limit
                is_valid = False
            if not is_valid:
                bad = next(t for t in ids if not 0 <= t < self.tokenizer.vocab_size)
                raise ApiError(f"token id {bad} is not in the vocabulary "
                               f"[0, {self.tokenizer.vocab_size})", param=param)
        return ids

    def max_tokens_for(self, requested: int | None, num_prompt_tokens: int, *,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
        """The context rule: prompt + max_tokens <= max_context, and at least one new token.
        None asks for all the room the context leaves."""
        limit = self.config.max_context
        if num_prompt_tokens == 0:
            raise ApiError("the prompt is empty", param=prompt_param)
        if num_prompt_tokens >= limit:
            raise ApiError(f"the prompt has {num_prompt_tokens} tokens; this model's context "
                           f"length is {limit} tokens (prompt plus at least one new token)",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return limit - num_prompt_tokens
        if requested < 1:
            raise ApiError(f"{param} must be an integer >= 1, got {requested}", param=param)
        if num_prompt_tokens + requested > limit:
            raise ApiError(f"this model's context length is {limit} tokens; the request needs "
                           f"{num_prompt_tokens + requested} ({num_prompt_tokens} in the prompt, "
                           f"{requested} for the completion): lower {param} or the prompt",
                           param=param, code="context_length_exceeded")
        return requested

    # ---------------------------------------------------------------- prompts
    def encode_text(self, text: str, add_special_tokens: bool = True,
                    param: str = "prompt") -> list[int]:
        _check_unicode(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> Prompt:
        try:
            text = self.render_chat(messages, add_generation_prompt)
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from None
        return Prompt(self.encode_text(text, False, "messages"), text)

    # ---------------------------------------------------------------- sampling
    def sampling_for(self, request: GenerationFields, max_tokens: int, logprobs: int | None,
                     seed: int | None) -> SamplingParams:
        fields: dict = {"max_tokens": max_tokens, "seed": seed, "logprobs": logprobs,
                        "ignore_eos": request.ignore_eos,
                        "stop_token_ids": tuple(request.stop_token_ids or ()),
                        "logit_bias": _bias_by_id(request.logit_bias or {})}
        for name in SAMPLING_FIELDS:
            value = getattr(request, name)
            if value is not None:
                fields[name] = value
        try:
            sampling = SamplingParams(**self.config.sampling_defaults.fill(fields))
        except ValueError as exc:
            raise sampling_error(exc, (*SAMPLING_FIELDS, "seed", "stop_token_ids",
                                       "max_tokens", "logprobs", "logit_bias")) from None
        return self.check_sampling(sampling)

    def check_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """What SamplingParams cannot know: the biased tokens are in this model's vocabulary."""
        self.check_token_ids([token_id for token_id, _ in sampling.logit_bias], "logit_bias")
        return sampling

    def stop_strings(self, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if stops:
            try:
                StopStringMatcher(stops)  # the matcher's own limits: count, length, non-empty
            except ValueError as exc:
                raise ApiError(str(exc), param="stop") from None
        return tuple(stops)

    def text_options(self, sampling: SamplingParams, stop: tuple[str, ...]) -> TextOptions:
        hidden = frozenset(self.tokenizer.eog_token_ids) | frozenset(sampling.stop_token_ids)
        return TextOptions(stop=stop, hidden_token_ids=hidden,
                           with_logprobs=sampling.logprobs is not None)

    # ---------------------------------------------------------------- running
    def start(self, prompt_ids: list[int], sampling: SamplingParams, options: TextOptions,
              arrival_s: float) -> Generation:
        """Submit one scheduler request. arrival_s: time.perf_counter() when the API request
        arrived (for TTFT / e2e)."""
        request = SubmitRequest(request_id=self.new_id("req"),
                                prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
                                sampling=sampling, arrival_time_s=time.time(),
                                cache_salt=self.config.cache_salt)
        timer = self.metrics.start_request(len(prompt_ids), arrival_s)
        return Generation(self.engine, request, self.tokenizer, options, timer)

    def start_choices(self, request: GenerationFields, prompts: list[Prompt],
                      max_tokens: list[int], logprobs: int | None,
                      arrival_s: float) -> list[Generation]:
        """n choices per prompt, numbered prompt-major: choice index = prompt * n + j."""
        if len(prompts) * request.n > MAX_CHOICES:
            raise ApiError(f"prompts x n must be at most {MAX_CHOICES}, got "
                           f"{len(prompts)} x {request.n}", param="n")
        stop = self.stop_strings(request.stop)
        plans = []
        for prompt, limit in zip(prompts, max_tokens, strict=True):
            for j in range(request.n):
                seed = None if request.seed is None else derive_seed(request.seed, j)
                sampling = self.sampling_for(request, limit, logprobs, seed)
                plans.append((prompt.token_ids, sampling, self.text_options(sampling, stop)))
        self.check_available(len(plans))  # everything validated: only now submit
        self.log_request("HTTP", prompts, plans[0][1])
        return [self.start(ids, sampling, options, arrival_s) for ids, sampling, options in plans]


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


def _check_unicode(text: str, param: str) -> None:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"); they are not text and no tokenizer
    takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{param} is not valid Unicode: {exc.reason} at character {exc.start}",
                       param=param) from None


def close_all(generations: Sequence[Generation]) -> None:
    for generation in generations:
        generation.close()


async def fan_in(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Outputs of several generations as they arrive, tagged with the generation's index."""
    if len(generations) == 1:
        try:
            async for output in generations[0].outputs():
                yield 0, output
        except Exception as exc:  # end the response with an error event, not a broken stream
            logger.exception("generation %s failed", generations[0].request_id)
            yield 0, GenerationOutput("", [], FINISH_ERROR, error=str(exc))
        return
    queue: asyncio.Queue[tuple[int, GenerationOutput | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for output in generation.outputs():
                queue.put_nowait((index, output))
        except Exception as exc:  # a bad delta must end this choice, not the whole response
            logger.exception("generation %s failed", generation.request_id)
            queue.put_nowait((index, GenerationOutput("", [], FINISH_ERROR, error=str(exc))))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, maybe_output = await queue.get()
            if maybe_output is None:
                remaining -= 1
            else:
                yield index, maybe_output
    finally:
        for task in tasks:
            task.cancel()
        close_all(generations)


async def collect_all(generations: Sequence[Generation]) -> list[GenerationOutput]:
    """Every generation to its end (aborting all of them if this is cancelled)."""
    try:
        return list(await asyncio.gather(*(g.collect() for g in generations)))
    finally:
        close_all(generations)


def usage(prompt_lengths: Sequence[int], generations: Sequence[Generation]) -> dict:
    """OpenAI usage: each prompt counted once, every choice's tokens. cached_tokens: per
    prompt, the fewest any of its choices got from the prefix cache."""
    num_prompt = sum(prompt_lengths)
    num_completion = sum(g.num_output_tokens for g in generations)
    per_prompt = max(1, len(generations) // max(1, len(prompt_lengths)))
    cached = sum(min(g.num_cached_tokens for g in generations[i:i + per_prompt])
                 for i in range(0, len(generations), per_prompt))
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse_event(payload: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"
