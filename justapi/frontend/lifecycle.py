"""The frontend's life beyond serving: the graceful drain at shutdown and the scheduler watch.

`drain`: on SIGTERM new requests are refused (503, /health 503) while the ones in flight run
to their end, for at most the grace period; what is left then is aborted (finish_reason
'abort') and the servers stop. `watch_scheduler`: the scheduler process is polled through
/proc; once it is gone every open request ends with an error at once (HTTP 503) and new ones
are refused, instead of waiting for a stream that will never come.
Owns: those two loops. Does not own: the servers (server.py) or the admission rule.
"""
from __future__ import annotations

import asyncio
import logging
import time

from justapi.frontend.engine_client import EngineClient
from justapi.frontend.server import FrontendServer
from justapi.health.watch import process_state

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
SCHEDULER_POLL_S = 0.1


async def drain(server: FrontendServer, grace_s: float) -> None:
    """Refuse new requests, let the running ones finish (at most grace_s), then stop."""
    server.serving.admission.start_draining()
    engine = server.serving.engine
    if server.num_in_flight:
        logger.info("shutting down: refusing new requests, %d in flight get up to %.0fs to "
                    "finish", server.num_in_flight, grace_s)
    deadline = time.monotonic() + grace_s
    while server.num_in_flight and not engine.scheduler_lost and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if engine.num_in_flight:
        logger.warning("grace period over: aborting %d request(s) still in flight",
                       engine.num_in_flight)
    await server.stop()


async def watch_scheduler(engine: EngineClient, pid: int) -> None:
    """Until the scheduler process `pid` exits; then fail every open request."""
    while process_state(pid) not in (None, "Z", "X"):
        await asyncio.sleep(SCHEDULER_POLL_S)
    logger.error("the scheduler (pid %d) is gone: failing %d request(s) in flight, refusing "
                 "new ones", pid, engine.num_in_flight)
    engine.fail_all(f"the scheduler (pid {pid}) exited")
