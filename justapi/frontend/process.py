"""The frontend process: one uvloop event loop running the HTTP API, the ZMQ client endpoint
and the link to the scheduler; reports its URL to the launcher once it listens.

SIGTERM (from the launcher) drains: new requests are refused (503) while those in flight get
up to `shutdown-grace-s` to finish; then what is left is aborted and it exits. The scheduler
process is watched: once it is gone, open requests wait for the new one the launcher starts
(restart-scheduler), or fail at once (503).
Owns: the frontend's event loop and its start-up handshake. Does not own: what is served
(justapi/frontend/server.py and below).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvloop

from justapi.config.serve import API_KEY_ENV
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.lifecycle import drain, watch_scheduler
from justapi.frontend.server import FrontendServer, FrontendSettings, build_serving
from justapi.launch.child import ChildSpec, report, start_child
from justapi.model.gguf_file import GGUFFile
from justapi.wire.auth import read_secret_key

logger = logging.getLogger(__name__)

RESTART_MARGIN_S = 30.0  # a new scheduler's own start-up (imports, tokenizer) beyond its workers


def settings_of(spec: ChildSpec) -> FrontendSettings:
    """Settings from the spec; secrets (API key, CURVE key) from the environment and the key
    file, never from the spec, which is on the command line for anyone to read in `ps`."""
    server = spec.config.server
    running_capacity = spec.config.scheduler.max_seqs * server.workers
    curve_key = read_secret_key(server.zmq_curve_secret_key) if server.zmq_curve_secret_key \
        else b""
    return FrontendSettings(
        scheduler_endpoint=spec.endpoints.scheduler_in,
        frontend_endpoint=spec.endpoints.frontend_in,
        zmq_endpoint=spec.endpoints.client,
        model_name=server.served_model_name,
        max_context=spec.config.model.max_context,
        zmq_curve_secret_key=curve_key.decode(),
        host=server.host, port=server.port, log_level=server.log_level,
        api_key=os.environ.get(API_KEY_ENV, ""),
        max_request_bytes=server.max_request_bytes,
        max_in_flight=running_capacity + server.max_queue,
        log_requests=server.log_requests,
        sampling_defaults=spec.config.sampling.given(),
        reasoning_parser=server.reasoning_parser,
        scheduling_policy=spec.config.scheduler.policy,
        pooling=spec.config.model.pooling, matryoshka=spec.config.model.matryoshka)


def restart_timeout_s(spec: ChildSpec) -> float:
    """How long open requests wait for a restarted scheduler (0: restart-scheduler is off):
    its start-up, which waits up to ready-timeout-s for its workers, and a margin."""
    if not spec.config.ops.restart_scheduler:
        return 0.0
    return spec.config.server.ready_timeout_s + RESTART_MARGIN_S


async def serve(spec: ChildSpec) -> None:
    settings = settings_of(spec)
    scheduler_pid = int(spec.extra.get("scheduler_pid", 0))
    engine = EngineClient(settings.scheduler_endpoint, settings.frontend_endpoint, scheduler_pid)
    try:
        serving = build_serving(GGUFFile(spec.model_path), engine, settings)
        server = FrontendServer(serving, settings)
        await engine.start()
        await server.start()
    except Exception as exc:  # report any start-up failure as one line, then exit
        logger.debug("start-up failed", exc_info=True)
        report(spec, error=f"{type(exc).__name__}: {exc}")
        await engine.close()
        raise SystemExit(1) from None
    report(spec, info={"http_url": server.http_url, "zmq": server.zmq_endpoint,
                       "model_name": serving.config.model_name})
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    watch = asyncio.ensure_future(watch_scheduler(
        engine, scheduler_pid, restart_timeout_s(spec))) if scheduler_pid else None
    waiter = asyncio.ensure_future(server.wait())
    await asyncio.wait([waiter, asyncio.ensure_future(stopping.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if stopping.is_set():
        await drain(server, spec.config.server.shutdown_grace_s)
    else:
        await server.stop()
    if watch is not None:
        watch.cancel()
    await engine.close()


def main() -> None:
    spec, _ = start_child()
    uvloop.run(serve(spec))


if __name__ == "__main__":
    main()
