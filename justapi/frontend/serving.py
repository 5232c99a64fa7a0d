"""One frontend process's serving context: settings, engine link, tokenizer, metrics, admission.

Every handler (serving_chat.py, serving_completions.py, zmq_server.py, api_server.py) takes a
Serving; its `prompts` (prompts.py) and `sampling_rules` (request_sampling.py) hold the request
rules. Owns: the serving settings, request ids, the model-name check, submitting one scheduler
request. Does not own: n choices (choices.py), SSE (sse.py), response shapes, text state.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from justapi.frontend.admission import Admission, RejectionCounter, unavailable
from justapi.frontend.engine_client import EngineClient, RequestStream
from justapi.frontend.errors import NOT_FOUND, SERVER_ERROR, ApiError
from justapi.frontend.generation import Generation, TextOptions
from justapi.frontend.metrics import FrontendMetrics, RequestTimer
from justapi.frontend.prompts import ChatRenderer, Prompt, Prompts
from justapi.frontend.reasoning.request import NO_REASONING, ReasoningSetup
from justapi.frontend.request_sampling import SamplingRules
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.frontend.tools.formats import GENERIC, ToolFormat
from justapi.sampling import SamplingDefaults, SamplingParams
from justapi.wire.protocol import SubmitRequest

logger = logging.getLogger(__name__)

LOGGED_PROMPT_CHARS = 2000  # --log-requests: longer prompts are cut in the log
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)
"""What a pooling request carries for sampling: nothing is sampled."""


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
    scheduling_policy: str = "fcfs"
    """The scheduler's policy: only "priority" takes a request's `priority` field."""
    pooling: str = ""
    """/v1/embeddings' pooling (protocol.POOLINGS); "" serves no embeddings."""
    is_matryoshka: bool = False
    """`dimensions` may ask for fewer than hidden_size leading dimensions."""
    hidden_size: int = 0
    """The model's hidden size: the length of a full embedding."""


class Serving:
    """Everything a request handler needs; one per frontend process."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, render_chat: ChatRenderer,
                 config: ServingConfig, metrics: FrontendMetrics, *,
                 tool_format: ToolFormat = GENERIC,
                 reasoning: ReasoningSetup = NO_REASONING) -> None:
        """tool_format: how the chat template's model writes tool calls (tools/formats.py);
        reasoning: how it thinks (reasoning/request.py)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.tool_format = tool_format
        self.reasoning = reasoning
        self.metrics = metrics
        self.prompts = Prompts(tokenizer, render_chat, config.max_context)
        self.sampling_rules = SamplingRules(tokenizer, config.sampling_defaults)
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

    def check_priority(self, priority: int) -> int:
        """A request's priority; 400 for a value other than 0 unless the scheduler orders by
        priority (as vLLM refuses it)."""
        if priority and self.config.scheduling_policy != "priority":
            raise ApiError(f"priority {priority} needs a server started with "
                           "--scheduling-policy priority", param="priority")
        return priority

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

    # ---------------------------------------------------------------- running
    def start(self, prompt_ids: list[int], sampling: SamplingParams, options: TextOptions,
              arrival_s: float, priority: int = 0) -> Generation:
        """Submit one scheduler request. arrival_s: time.perf_counter() when the API request
        arrived (for TTFT / e2e); priority: checked by check_priority."""
        request = SubmitRequest(request_id=self.new_id("req"),
                                prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
                                sampling=sampling, arrival_time_s=time.time(),
                                priority=priority, cache_salt=self.config.cache_salt)
        timer = self.metrics.start_request(len(prompt_ids), arrival_s)
        return Generation(self.engine, request, self.tokenizer, options, timer)

    def start_pooling(self, prompt_ids: list[int], arrival_s: float,
                      priority: int = 0) -> tuple[RequestStream, RequestTimer]:
        """Submit one pooling (embedding) request with the server's pooling; its stream ends
        with one delta carrying the pooled state."""
        request = SubmitRequest(request_id=self.new_id("emb"),
                                prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
                                sampling=POOLING_SAMPLING, arrival_time_s=time.time(),
                                priority=priority, cache_salt=self.config.cache_salt,
                                pooling=self.config.pooling)
        timer = self.metrics.start_request(len(prompt_ids), arrival_s)
        return self.engine.submit(request), timer
