"""The frontend process: one uvloop event loop running the HTTP API, the ZMQ client endpoint
and the link to the scheduler; reports its URL to the launcher once it listens.

SIGTERM (from the launcher) stops accepting, aborts what is still running and exits.
Owns: the frontend's event loop and its start-up handshake. Does not own: what is served
(justapi/frontend/server.py and below).
"""
from __future__ import annotations

import asyncio
import logging
import signal

import uvloop

from justapi.child import ChildSpec, report, start_child
from justapi.frontend.engine_client import EngineClient
from justapi.frontend.server import FrontendServer, FrontendSettings, build_serving
from justapi.gguf_file import GGUFFile

logger = logging.getLogger(__name__)


def settings_of(spec: ChildSpec) -> FrontendSettings:
    server = spec.config.server
    return FrontendSettings(
        scheduler_endpoint=spec.endpoints.scheduler_in,
        frontend_endpoint=spec.endpoints.frontend_in,
        zmq_endpoint=spec.endpoints.client,
        model_name=server.served_model_name,
        max_context=spec.config.model.max_context,
        host=server.host, port=server.port, log_level=server.log_level)


async def serve(spec: ChildSpec) -> None:
    settings = settings_of(spec)
    engine = EngineClient(settings.scheduler_endpoint, settings.frontend_endpoint)
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
    waiter = asyncio.ensure_future(server.wait())
    await asyncio.wait([waiter, asyncio.ensure_future(stopping.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    await server.stop()
    await engine.close()


def main() -> None:
    spec, _ = start_child()
    uvloop.run(serve(spec))


if __name__ == "__main__":
    main()
