"""The frontend's parts assembled in one event loop: engine link, HTTP server, ZMQ endpoint.

`build_serving` reads the GGUF's tokenizer, chat template and sampling defaults once;
`FrontendServer` runs uvicorn (httptools) and the ZMQ client endpoint beside the
EngineClient's reader, all in the caller's (uvloop) event loop, and reports where it listens. The process shell
(justapi/frontend/process.py) owns signals, the launcher handshake and the loop itself.
Owns: start and stop order of the frontend's servers. Does not own: what they serve.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from justapi.frontend.api_server import build_app, make_http_server
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.guards import DEFAULT_MAX_REQUEST_BYTES
from justapi.frontend.metrics import FrontendMetrics
from justapi.frontend.reasoning.request import ReasoningSetup
from justapi.frontend.serving import Serving, ServingConfig
from justapi.frontend.text.chat_template import ChatTemplate
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.frontend.tools.formats import detect_tool_format
from justapi.frontend.zmq_server import ZmqServer
from justapi.model.gguf_file import GGUFFile
from justapi.model.info import is_matryoshka, model_pooling, model_sampling_defaults
from justapi.sampling import SamplingDefaults

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.01


@dataclass(frozen=True)
class FrontendSettings:
    """Where the frontend listens and what it serves."""

    scheduler_endpoint: str
    """The scheduler's PULL socket (SubmitRequest / AbortRequest go there)."""
    frontend_endpoint: str
    """This frontend's PULL socket (TokenDeltas / SchedulerStats arrive there)."""
    zmq_endpoint: str
    """The ROUTER for justapi.client (ipc:// in the runtime dir, or tcp://127.0.0.1:5555)."""
    model_name: str = ""
    """The id clients use; "" takes the GGUF's general.name."""
    max_context: int = 0
    """Prompt + output tokens per request; 0 takes the GGUF's context length."""
    zmq_curve_secret_key: str = ""
    """z85 CURVE secret key of the ZMQ endpoint; "" accepts plain connections (loopback)."""
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (see FrontendServer.http_url)."""
    log_level: str = "info"
    api_key: str = field(default="", repr=False)
    """Bearer key every HTTP route but /health needs; "" serves without one."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Larger HTTP request bodies are refused with 413."""
    max_in_flight: int = 0
    """Most scheduler requests in flight (running capacity + max-queue); 0: no bound."""
    log_requests: bool = False
    """Log prompts and parameters of each request."""
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    """Sampling defaults set by flag or TOML (SamplingConfig.given()); the GGUF's, else
    llama-server's, fill in the rest."""
    reasoning_parser: str = "auto"
    """How replies are split into thinking and answer (auto: from the chat template)."""
    scheduling_policy: str = "fcfs"
    """The scheduler's policy (requests' `priority` counts under "priority" only)."""
    pooling: str = "auto"
    """ModelConfig.pooling: /v1/embeddings' pooling (auto: the GGUF's pooling_type)."""
    matryoshka: str = "auto"
    """ModelConfig.matryoshka: whether `dimensions` may truncate."""


def build_serving(gguf: GGUFFile, engine: EngineClient, settings: FrontendSettings) -> Serving:
    """Tokenizer and chat template from the GGUF, limits from settings (or the file)."""
    tokenizer = Tokenizer.from_gguf(gguf)
    template = ChatTemplate.from_gguf(gguf, tokenizer.template_tokens)
    model_context = int(gguf.arch_get("context_length", 0) or 0)
    max_context = settings.max_context or model_context
    if max_context <= 0:
        raise ValueError(f"{gguf.path}: no context length in the GGUF; set max-context")
    if model_context:
        max_context = min(max_context, model_context)
    name = settings.model_name or gguf.name
    metrics = FrontendMetrics(name, lambda: engine.stats,
                              restarts_source=lambda: engine.num_restarts)
    path = Path(gguf.path)
    aliases = tuple(a for a in dict.fromkeys((gguf.name, path.name, path.stem, str(path))) if a != name)
    defaults = SamplingDefaults.resolve(settings.sampling_defaults, model_sampling_defaults(gguf))
    logger.info("sampling defaults for fields a request leaves out: %s", defaults.describe())
    config = ServingConfig(model_name=name, max_context=max_context, model_aliases=aliases,
                           max_in_flight=settings.max_in_flight,
                           log_requests=settings.log_requests, sampling_defaults=defaults,
                           scheduling_policy=settings.scheduling_policy,
                           pooling=model_pooling(gguf, settings.pooling),
                           is_matryoshka=is_matryoshka(gguf, settings.matryoshka),
                           hidden_size=int(gguf.arch_get("embedding_length", 0) or 0))
    tool_format = detect_tool_format(template.source)
    reasoning = ReasoningSetup.from_template(template.source, tokenizer, settings.reasoning_parser)
    logger.info("tool calls in the %s format; reasoning parser: %s", tool_format.name,
                reasoning.format.name if reasoning.format else "none")
    return Serving(engine, tokenizer, template.render, config, metrics, tool_format=tool_format,
                   reasoning=reasoning)


class FrontendServer:
    """HTTP + ZMQ servers over one Serving; `start()`, then `wait()`, or `stop()`."""

    def __init__(self, serving: Serving, settings: FrontendSettings) -> None:
        self.serving = serving
        self.app = build_app(serving, api_key=settings.api_key,
                             max_request_bytes=settings.max_request_bytes)
        self._http = make_http_server(self.app, settings.host, settings.port, settings.log_level)
        self._zmq = ZmqServer(serving, settings.zmq_endpoint,
                              curve_secret_key=settings.zmq_curve_secret_key.encode() or None)
        self._tasks: list[asyncio.Task] = []

    @property
    def http_url(self) -> str:
        host, port = self._http.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def zmq_endpoint(self) -> str:
        return self._zmq.endpoint

    @property
    def num_in_flight(self) -> int:
        """Scheduler requests not finished, plus ZMQ generations whose last chunk is unsent."""
        return self.serving.engine.num_in_flight + self._zmq.num_running

    async def start(self) -> None:
        """Start serving; returns once HTTP listens (raises if it could not start)."""
        self._tasks = [asyncio.ensure_future(self._http.serve()),
                       asyncio.ensure_future(self._zmq.run())]
        while not self._http.started:
            if self._tasks[0].done():
                self._tasks[0].result()  # uvicorn's own error, if it raised one
                raise RuntimeError("the HTTP server stopped during start-up (port in use?)")
            await asyncio.sleep(STARTUP_POLL_S)
        logger.info("serving %s on %s, ZMQ clients on %s", self.serving.config.model_name,
                    self.http_url, self.zmq_endpoint)

    async def wait(self) -> None:
        """Until the HTTP server exits (uvicorn stops on SIGINT/SIGTERM by itself)."""
        await asyncio.shield(self._tasks[0])

    async def stop(self) -> None:
        """Stop accepting, abort what is still running (its clients see finish_reason
        'abort'), let uvicorn finish those responses, close the ZMQ endpoint."""
        self._http.should_exit = True
        self.serving.engine.abort_all()
        if not self._tasks:
            return
        http_task, zmq_task = self._tasks
        await asyncio.gather(http_task, return_exceptions=True)
        zmq_task.cancel()
        await asyncio.gather(zmq_task, return_exceptions=True)
