"""The frontend's life beyond serving: the graceful drain at shutdown and the scheduler watch.

`drain`: on SIGTERM new requests are refused (503, /health 503) while the ones in flight run
to their end, for at most the grace period; what is left then is aborted (finish_reason
'abort') and the servers stop. `watch_scheduler`: the scheduler process is polled through
/proc. Once it is gone, with restart-scheduler the open requests are held (and new ones
accepted) until the launcher's new scheduler takes them over (EngineClient resubmits them);
without it, or when no new one comes in time, every open request ends with an error at once
(HTTP 503) and new ones are refused, instead of waiting for a stream that will never come.
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
SCHEDULER_POLL_S = 0.05


async def drain(server: FrontendServer, grace_s: float) -> None:
    """Refuse new requests, let the running ones finish (at most grace_s), then stop."""
    server.serving.admission.start_draining()
    engine = server.serving.engine
    if engine.is_restarting:  # the pool is stopping: no scheduler will take them over
        engine.fail_all("the scheduler exited and the server is stopping")
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


async def watch_scheduler(engine: EngineClient, pid: int, restart_timeout_s: float = 0.0) -> None:
    """Follow the scheduler process `pid` and its successors. restart_timeout_s: how long the
    open requests wait for a new scheduler (0: restart-scheduler is off, fail them at once)."""
    while True:
        while process_state(pid) not in (None, "Z", "X"):
            await asyncio.sleep(SCHEDULER_POLL_S)
        if engine.scheduler_pid != pid:  # its successor already took over
            pid = engine.scheduler_pid
            continue
        if restart_timeout_s > 0:
            logger.warning("the scheduler (pid %d) is gone: holding %d request(s) for the new "
                           "one", pid, engine.num_in_flight)
            engine.detach()
            try:
                await asyncio.wait_for(engine.attached.wait(), restart_timeout_s)
            except asyncio.TimeoutError:
                pass
            if engine.scheduler_lost:  # failed meanwhile (the server is stopping)
                return
            if engine.scheduler_pid != pid:
                pid = engine.scheduler_pid
                continue
        logger.error("the scheduler (pid %d) is gone: failing %d request(s) in flight, refusing "
                     "new ones", pid, engine.num_in_flight)
        engine.fail_all(f"the scheduler (pid {pid}) exited")
        return
