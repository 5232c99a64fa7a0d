"""The frontend across a scheduler restart, over real ZMQ sockets: while the scheduler is down
open requests are held and new ones accepted; the new scheduler (its SchedulerStarted) gets
each open request once, as prompt + the tokens already delivered, and none that finished or
was aborted; what was queued for the dead one never reaches it, what the dead one sent but
is read only after the take-over is dropped (recomputed); the streams go on. The
scheduler watch follows the new process, and fails the requests when none comes in time."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import zmq

from justapi.frontend.engine_client import EngineClient, RequestDelta, RequestStream
from justapi.frontend.lifecycle import watch_scheduler
from justapi.sampling import SamplingParams
from justapi.wire import transport
from justapi.wire.protocol import (
    AbortRequest,
    SchedulerStarted,
    SubmitRequest,
    TokenDeltas,
)
from tests.support.api_stack import eventually, run

OLD_PID, NEW_PID = 1_000_001, 1_000_002


class Scheduler:
    """The scheduler's two sockets: PULL bound where the frontend pushes, PUSH to the frontend."""

    def __init__(self, context: zmq.Context, inbox: str, frontend: str) -> None:
        self.inbox = transport.make_socket(context, zmq.PULL, inbox, bind=True)
        self.outbox = transport.make_socket(context, zmq.PUSH, frontend, bind=False)
        self.received: list[object] = []

    def receive(self) -> list[object]:
        while self.inbox.poll(200):
            self.received += [m for _, m in transport.drain(self.inbox)]
        return self.received

    def send(self, message: object) -> None:
        transport.send(self.outbox, message)

    def deltas(self, tokens: dict[str, list[int]], finished: tuple[str, ...] = (),
               pid: int = 0) -> None:
        ids = list(tokens)
        self.send(TokenDeltas(
            step_id=1, request_ids=ids,
            num_new_tokens=np.asarray([len(tokens[i]) for i in ids], np.int32),
            token_ids=np.asarray([t for i in ids for t in tokens[i]], np.int32),
            finish_reasons=["length" if i in finished else "" for i in ids], scheduler_pid=pid))

    def die(self) -> None:
        self.inbox.close(0)
        self.outbox.close(0)


def _request(request_id: str) -> SubmitRequest:
    return SubmitRequest(request_id, np.asarray([2, 3, 4], np.int32),
                         SamplingParams(max_tokens=10, seed=7))


async def _drain(stream: RequestStream) -> list[RequestDelta]:
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait())
    return out


def test_open_requests_are_held_and_resubmitted_with_what_they_delivered(tmp_path) -> None:
    async def scenario() -> None:
        context = zmq.Context()
        inbox = transport.ipc_endpoint(str(tmp_path), "scheduler")
        frontend = transport.ipc_endpoint(str(tmp_path), "frontend")
        engine = EngineClient(inbox, frontend, scheduler_pid=OLD_PID)
        await engine.start()
        old = Scheduler(context, inbox, frontend)
        streams = {rid: engine.submit(_request(rid)) for rid in ("a", "b", "c")}
        old.send(SchedulerStarted(OLD_PID, 0))  # the first scheduler: nothing to resubmit
        old.deltas({"a": [5, 6], "b": [7, 8], "c": [9]}, finished=("b",), pid=OLD_PID)
        assert await eventually(lambda: len(streams["a"].delivered) == 2)
        engine.abort("c")  # sent; the dead scheduler never confirms it
        assert len([m for m in old.receive() if isinstance(m, SubmitRequest)]) == 3
        old.die()
        streams["d"] = engine.submit(_request("d"))  # queued on the link to the dead one
        engine.detach()
        assert engine.is_restarting and "restarting" in engine.health_problems()[0]
        streams["e"] = engine.submit(_request("e"))  # held
        streams["f"] = engine.submit(_request("f"))
        engine.abort("f")  # no scheduler to tell: it ends here
        assert [d.finish_reason for d in await _drain(streams["f"])] == ["abort"]

        new = Scheduler(context, inbox, frontend)
        new.send(SchedulerStarted(NEW_PID, 1))
        assert await eventually(lambda: engine.num_restarts == 1)
        assert not engine.is_restarting and engine.scheduler_pid == NEW_PID
        received = new.receive()
        assert len(received) == 3 and all(isinstance(m, SubmitRequest) for m in received)
        resubmitted = {m.request_id: m.output_token_ids.tolist() for m in received}
        assert resubmitted == {"a": [5, 6], "d": [], "e": []}  # each once: d's first copy died
        assert [d.finish_reason for d in await _drain(streams["c"])] == ["", "abort"]
        a = received[0]
        assert a.prompt_token_ids.tolist() == [2, 3, 4] and a.sampling.seed == 7
        new.deltas({"a": [99]}, pid=OLD_PID)  # the dead one's, read late: recomputed, dropped
        new.deltas({"a": [10]}, finished=("a",), pid=NEW_PID)
        assert await eventually(lambda: streams["a"].queue.qsize() == 2)
        assert [t for d in await _drain(streams["a"]) for t in d.token_ids] == [5, 6, 10]
        engine.abort("e")
        assert any(isinstance(m, AbortRequest) and m.request_ids == ["e"] for m in new.receive())
        new.die()
        await engine.close()
        context.term()

    run(scenario)


def test_the_watch_follows_the_new_scheduler_or_fails_the_requests_in_time(tmp_path) -> None:
    async def scenario() -> None:
        inbox = transport.ipc_endpoint(str(tmp_path), "scheduler")
        frontend = transport.ipc_endpoint(str(tmp_path), "frontend")
        first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        engine = EngineClient(inbox, frontend, scheduler_pid=first.pid)
        await engine.start()
        stream = engine.submit(_request("a"))
        watch = asyncio.ensure_future(watch_scheduler(engine, first.pid, restart_timeout_s=2.0))
        first.kill()
        first.wait()
        assert await eventually(lambda: engine.is_restarting)
        context = zmq.Context()
        new = Scheduler(context, inbox, frontend)
        new.send(SchedulerStarted(second.pid, 1))
        assert await eventually(lambda: engine.num_restarts == 1)
        assert [m.request_id for m in new.receive()] == ["a"]
        second.kill()  # this one is not restarted in time
        second.wait()
        assert await eventually(lambda: watch.done(), timeout_s=10.0)
        assert engine.scheduler_lost and not engine.is_restarting
        deltas = await _drain(stream)
        assert deltas[-1].finish_reason == "error" and str(second.pid) in str(deltas[-1].error)
        new.die()
        await engine.close()
        context.term()

    run(scenario)
