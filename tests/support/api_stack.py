"""The frontend's test stack: the real FastAPI app, Serving and EngineClient over real ZMQ
sockets to a FakeScheduler thread, with the SmolLM2 GGUF's real tokenizer and chat template.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from fastapi import FastAPI

from justapi.frontend.api_server import build_app
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.metrics import FrontendMetrics
from justapi.frontend.reasoning.request import NO_REASONING, ReasoningSetup
from justapi.frontend.serving import Serving, ServingConfig
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.frontend.tools.formats import GENERIC, ToolFormat
from justapi.model.gguf_file import GGUFFile, default_model_path
from justapi.sampling import SamplingDefaults
from justapi.wire import transport
from justapi.wire.protocol import SubmitRequest
from tests.support.api_fake_scheduler import FAKE_HIDDEN, FakeScheduler, Script

MODEL = "smollm2-test"
TEXTS = (" Hello world! The quick brown fox jumps over the lazy dog.",
         " Paris is the capital of France, and Berlin is the capital of Germany.",
         " Café, naïve, 東京, and emoji 🎉 make a multi-byte sentence.")


@functools.lru_cache(maxsize=1)
def smollm_gguf() -> GGUFFile:
    return GGUFFile(default_model_path())


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(smollm_gguf())


@functools.lru_cache(maxsize=1)
def chat_template() -> ChatTemplate:
    return ChatTemplate.from_gguf(smollm_gguf(), tokenizer().template_tokens)


def text_tokens(index: int) -> list[int]:
    return tokenizer().encode(TEXTS[index % len(TEXTS)], add_special_tokens=False)


def seeded_script(request: SubmitRequest) -> list[int]:
    """TEXTS[seed % 3] (TEXTS[0] without a seed), then EOS."""
    seed = request.sampling.seed or 0
    return text_tokens(seed) + [tokenizer().eos_token_id]


def endless_script(request: SubmitRequest) -> list[int]:
    return text_tokens(0) * 200


@dataclass
class Stack:
    fake: FakeScheduler
    engine: EngineClient
    serving: Serving
    app: FastAPI
    http: httpx.AsyncClient
    runtime_dir: str

    async def wait_healthy(self) -> None:
        for _ in range(500):
            if self.engine.is_healthy():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"engine never healthy: {self.engine.health_problems()}")

    async def next_snapshot(self) -> None:
        """Wait for a SchedulerStats built after now."""
        now_s = time.time()
        if not await eventually(lambda: self.engine.stats is not None
                                and self.engine.stats.time_s > now_s):
            raise AssertionError("no new scheduler snapshot")


@asynccontextmanager
async def serving_stack(script: Script = seeded_script, *, max_context: int = 256,
                        tokens_per_step: int = 1, step_s: float = 0.001,
                        tmp_dir: str | None = None,
                        sampling_defaults: SamplingDefaults | None = None,
                        template: ChatTemplate | None = None,
                        tool_format: ToolFormat = GENERIC,
                        reasoning: ReasoningSetup = NO_REASONING,
                        scheduling_policy: str = "fcfs", pooling: str = "last",
                        is_matryoshka: bool = False) -> AsyncIterator[Stack]:
    """The stack over SmolLM2's tokenizer; `template` (default: SmolLM2's own), `tool_format`
    and `reasoning` as build_serving would find them for another template."""
    runtime_dir = tmp_dir or transport.make_runtime_dir("justapi-test-")
    fake = FakeScheduler(runtime_dir, script, eos_token_ids=tuple(tokenizer().eog_token_ids),
                         tokens_per_step=tokens_per_step, step_s=step_s).start()
    engine = EngineClient(fake.scheduler_endpoint, fake.frontend_endpoint)
    await engine.start()
    metrics = FrontendMetrics(MODEL, lambda: engine.stats)
    template = template or chat_template()
    config = ServingConfig(MODEL, max_context,
                           sampling_defaults=sampling_defaults or SamplingDefaults.resolve(),
                           scheduling_policy=scheduling_policy, pooling=pooling,
                           is_matryoshka=is_matryoshka, hidden_size=FAKE_HIDDEN)
    serving = Serving(engine, tokenizer(), template.render, config, metrics,
                      tool_format=tool_format, reasoning=reasoning)
    app = build_app(serving)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=30)
    try:
        yield Stack(fake, engine, serving, app, http, runtime_dir)
    finally:
        await http.aclose()
        await engine.close()
        fake.stop()
        if tmp_dir is None:
            transport.remove_runtime_dir(runtime_dir)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Wait (without blocking the event loop) until condition() holds."""
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return True
        await asyncio.sleep(0.005)
    return condition()


def run(test: Callable[..., Coroutine[Any, Any, None]], *args: Any, **kwargs: Any) -> None:
    """Run one async test scenario in a fresh event loop."""
    asyncio.run(test(*args, **kwargs))


def sse_events(body: bytes) -> list[Any]:
    """Parse an SSE body into JSON objects, with the literal '[DONE]' kept as a string."""
    events: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: "):]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events
