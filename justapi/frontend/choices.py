"""The n choices of one API request: one Generation per (prompt, sample), run as a group.

Choices are numbered prompt-major (prompt p, sample j -> index p * n + j). Starts them once
every choice's request is valid, fans their outputs back in (or collects them whole), aborts
them all when the response ends early, and counts their usage. Owns: that group. Does not own:
one request's text (generation.py), chunk shapes (serving_chat.py, serving_completions.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from justapi.frontend.errors import ApiError
from justapi.frontend.generation import Generation, GenerationOutput, OutputWatch, TextOptions
from justapi.frontend.openai_models import GenerationFields
from justapi.frontend.prompts import Prompt
from justapi.frontend.request_sampling import derive_seed
from justapi.frontend.serving import Serving
from justapi.sampling import StructuredOutput
from justapi.wire.protocol import FINISH_ERROR

logger = logging.getLogger(__name__)

MAX_CHOICES = 64  # prompts x n of one request


@dataclass(frozen=True)
class OutputRules:
    """What a request's output must be, beyond its sampling fields."""

    structured: StructuredOutput | None = None
    """The checked output constraint (response_format, tool calls, ...)."""
    show_special_tokens: bool = False
    """Keep special tokens in the text (a tool-call trigger that is one)."""
    param: str = ""
    """The request field that carried `structured` (for a 400 naming it)."""
    approximated: tuple[str, ...] = ()
    """Schema keywords compiled best effort as a closer form (reported in a header)."""
    watch: Callable[[], OutputWatch] | None = None
    """Each choice's watch over its text (a structured reply's check, tool calls)."""

    def text_options(self, options: TextOptions) -> TextOptions:
        return replace(options, watch=self.watch) if self.watch is not None else options

    def refusal(self, error: str | None) -> ApiError | None:
        """A 400 when the engine could not compile the constraint against the vocabulary (the
        frontend's check passed, e.g. a grammar naming a special token the model lacks)."""
        kind = self.structured.kind if self.structured else None
        if kind is None or not (error or "").startswith(f"{kind}: "):
            return None
        return ApiError(f"{self.param}: {error}", param=self.param or None)


def start_choices(serving: Serving, request: GenerationFields, prompts: list[Prompt],
                  max_tokens: list[int], logprobs: int | None, arrival_s: float, *,
                  output: OutputRules = OutputRules()) -> list[Generation]:
    """n choices per prompt, numbered prompt-major: choice index = prompt * n + j."""
    if len(prompts) * request.n > MAX_CHOICES:
        raise ApiError(f"prompts x n must be at most {MAX_CHOICES}, got "
                       f"{len(prompts)} x {request.n}", param="n")
    rules = serving.sampling_rules
    priority = serving.check_priority(request.priority)
    stop = rules.stop_strings(request.stop)
    plans = []
    for prompt, limit in zip(prompts, max_tokens, strict=True):
        for j in range(request.n):
            seed = None if request.seed is None else derive_seed(request.seed, j)
            sampling = rules.sampling_for(request, limit, logprobs, seed,
                                          structured=output.structured)
            options = output.text_options(
                rules.text_options(sampling, stop, output.show_special_tokens))
            plans.append((prompt.token_ids, sampling, options))
    serving.check_available(len(plans))  # everything validated: only now submit
    serving.log_request("HTTP", prompts, plans[0][1])
    return [serving.start(ids, sampling, options, arrival_s, priority)
            for ids, sampling, options in plans]


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


async def collect_choices(serving: Serving, generations: Sequence[Generation],
                          rules: OutputRules = OutputRules()) -> list[GenerationOutput]:
    """Every choice whole, in index order; the first failed one fails the response (a 400 if
    its output constraint did not compile)."""
    outputs = await collect_all(generations)
    for output in outputs:
        if output.finish_reason == FINISH_ERROR:
            raise rules.refusal(output.error) or serving.generation_failed(output.error)
    return outputs


def usage(prompt_lengths: Sequence[int], generations: Sequence[Generation],
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI usage: each prompt counted once, every choice's tokens. cached_tokens: per
    prompt, the fewest any of its choices got from the prefix cache. reasoning_tokens (a
    reasoning model's, all choices'): reported in completion_tokens_details."""
    num_prompt = sum(prompt_lengths)
    num_completion = sum(g.num_output_tokens for g in generations)
    per_prompt = max(1, len(generations) // max(1, len(prompt_lengths)))
    cached = sum(min(g.num_cached_tokens for g in generations[i:i + per_prompt])
                 for i in range(0, len(generations), per_prompt))
    out = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
           "total_tokens": num_prompt + num_completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out
