"""The multi-turn workload of `justapi bench serve`: conversations whose every turn sends the
whole transcript so far (the previous prompts and the server's own answers) plus a short new
user message, as a chat client does; a server with a prefix cache computes little of it.

    turn 1: "{context}\\n\\nUser: {question 1}\\nAssistant:"          (group "turn-1")
    turn k: turn k-1's prompt + its answer + "\\nUser: {question k}\\nAssistant:"  ("turns-2+")

Owns: the conversations (seeded) and running them, at most `concurrency` at once, each turn
after the previous one's answer. Does not own: HTTP and timing (client.py), statistics.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from justapi.bench.client import (ClientConfig, RequestRecord, RunResult, gather_until_sigint,
                                  send_request)
from justapi.bench.workloads import BenchRequest, PromptSizer, WorkloadOptions

CONTEXT_TOKENS = 512  # the first turn's context (--prompt-tokens)
QUESTION_TOKENS = 32  # each user message
MAX_TOKENS = 64  # each answer (--max-tokens)
FIRST_GROUP, LATER_GROUP = "turn-1", "turns-2+"


@dataclass(frozen=True)
class Conversation:
    """One conversation: its context and one user message per turn."""

    index: int
    context: str
    questions: tuple[str, ...]
    max_tokens: int
    context_tokens: int


def build_conversations(options: WorkloadOptions, sizer: PromptSizer) -> list[Conversation]:
    """options.num_requests conversations of options.turns turns, identical for a seed."""
    rng = random.Random(options.seed)
    context_tokens = options.prompt_tokens or CONTEXT_TOKENS
    out = []
    for i in range(options.num_requests):
        context = sizer.make_text(rng, context_tokens)
        questions = tuple(sizer.make_text(rng, QUESTION_TOKENS).rstrip(".") + "?"
                          for _ in range(options.turns))
        out.append(Conversation(i, context, questions, options.max_tokens or MAX_TOKENS,
                                context_tokens))
    return out


def turn_request(conversation: Conversation, turn: int, history: str) -> BenchRequest:
    """Turn `turn` (0-based) given the transcript so far (empty for the first turn)."""
    opening = conversation.context + "\n\n" if turn == 0 else history
    prompt = f"{opening}User: {conversation.questions[turn]}\nAssistant:"
    num_turns = len(conversation.questions)
    estimate = conversation.context_tokens + (turn + 1) * (QUESTION_TOKENS + 4) + \
        turn * conversation.max_tokens
    return BenchRequest(conversation.index * num_turns + turn, prompt, estimate,
                        conversation.max_tokens, group=FIRST_GROUP if turn == 0 else LATER_GROUP)


async def run_conversations(config: ClientConfig, conversations: list[Conversation],
                            concurrency: int | None, show_progress: bool = False) -> RunResult:
    """Every conversation turn by turn, at most `concurrency` conversations at once; a failed
    turn ends its conversation. SIGINT stops the run as run_requests does."""
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(concurrency or len(conversations))
    num_turns = sum(len(c.questions) for c in conversations)
    limits = httpx.Limits(max_connections=concurrency or len(conversations))
    with tqdm(total=num_turns, unit="turn", disable=not show_progress, file=sys.stderr) as bar:
        async with httpx.AsyncClient(limits=limits,
                                     timeout=httpx.Timeout(config.timeout_s, connect=10.0)) as client:
            run_start = time.perf_counter()

            async def converse(conversation: Conversation) -> None:
                history = ""
                async with gate:
                    for turn in range(len(conversation.questions)):
                        request = turn_request(conversation, turn, history)
                        record = await send_request(client, config, request, run_start,
                                                    keep_text=True)
                        records.append(record)
                        bar.update(1)
                        if not record.ok:
                            return
                        history = request.prompt + record.output_text + "\n"

            tasks = [asyncio.create_task(converse(c)) for c in conversations]
            interrupted = await gather_until_sigint(tasks)
            duration_s = time.perf_counter() - run_start
    records.sort(key=lambda record: record.index)
    return RunResult(records, duration_s, interrupted)
