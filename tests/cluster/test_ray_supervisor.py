"""The launcher's view of Ray workers, one transition at a time (justapi/cluster/supervisor.py):
admit the key, start, watch; a death while serving re-admits the restarted process's new key;
a worker that cannot start fails the launch with its reason; one Ray will not restart goes
down; fences hit only the process the verdict is about. Ray's calls are scripted here (the
real ones run in tests/cluster/test_ray_cluster.py); its exception classes are Ray's own."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import ray.exceptions as ray_exceptions  # the test extra installs Ray

from justapi.cluster.supervisor import RETRY_S, RayWorkerSupervisor, WorkerSlot, WorkerStartError
from justapi.wire.protocol import FenceWorker

PENDING = object()  # a call that has not returned


class Ref:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome


class Actor:
    """Answers each method's calls from a script (values or exceptions), else stays pending."""

    def __init__(self) -> None:
        self.script: dict[str, list[Any]] = defaultdict(list)
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        actor = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Ref:
                actor.calls.append((name, args))
                script = actor.script[name]
                return Ref(script.pop(0) if script else PENDING)

        return Method


class Ray:
    exceptions = ray_exceptions

    def __init__(self) -> None:
        self.killed: list[tuple[Actor, bool]] = []

    def wait(self, refs: list[Ref], timeout: float = 0, num_returns: int = 1) -> tuple[list, list]:
        ready = [r for r in refs if r.outcome is not PENDING]
        return ready, [r for r in refs if r.outcome is PENDING]

    def get(self, ref: Ref) -> Any:
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    def kill(self, actor: Actor, no_restart: bool = True) -> None:
        self.killed.append((actor, no_restart))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def setup() -> tuple[RayWorkerSupervisor, Actor, Ray, list, Clock]:
    ray, clock, admitted = Ray(), Clock(), []
    supervisor = RayWorkerSupervisor(ray, lambda index, key: admitted.append((index, key)), clock)
    actor = Actor()
    actor.script["identity"].append({"public_key": "key-1", "pid": 101})
    actor.script["start"].append({"pid": 101, "host": "10.0.0.2", "device": "cpu"})
    supervisor.add(WorkerSlot(0, actor, "node-a", "10.0.0.2", {"name": "seg"}))
    return supervisor, actor, ray, admitted, clock


def run(supervisor: RayWorkerSupervisor, turns: int = 4, starting: bool = False) -> None:
    for _ in range(turns):
        supervisor.check(starting=starting)


def test_a_worker_is_admitted_before_it_starts_then_watched():
    supervisor, actor, _, admitted, _ = setup()
    run(supervisor, starting=True)
    slot = supervisor.slots[0]
    assert admitted == [(0, "key-1")] and slot.state == "running" and slot.pid == 101
    assert [name for name, _ in actor.calls] == ["identity", "start", "wait_stopped"]
    assert actor.calls[1][1] == ({"name": "seg"},)  # started on its host's pool


def test_a_death_while_serving_readmits_the_restarted_process(caplog):
    supervisor, actor, _, admitted, clock = setup()
    run(supervisor)
    slot = supervisor.slots[0]
    slot.pending = Ref(ray_exceptions.ActorUnavailableError("restarting", b"0" * 16))
    run(supervisor)
    assert slot.state == "identity" and slot.num_restarts == 1 and supervisor.num_restarts == 1
    assert "worker 0 (pid 101) on host 10.0.0.2 died; Ray restarts it (restart 1)" in caplog.text
    actor.script["identity"].append({"public_key": "key-2", "pid": 202})
    actor.script["start"].append({"pid": 202, "host": "10.0.0.2", "device": "cpu"})
    run(supervisor)
    assert slot.state == "identity"  # asked again only after RETRY_S
    clock.now += RETRY_S
    run(supervisor)
    assert admitted[-1] == (0, "key-2") and slot.state == "running" and slot.pid == 202


def test_a_worker_that_cannot_start_fails_the_launch_with_its_reason():
    supervisor, actor, ray, _, _ = setup()
    actor.script["start"][0] = ray_exceptions.RayTaskError(
        "start", "Traceback...", ValueError("no such file: /models/m.gguf"))
    with pytest.raises(WorkerStartError, match="worker 0 on host 10.0.0.2 failed to start: "
                                               "ValueError: no such file"):
        run(supervisor, starting=True)
    assert supervisor.slots[0].state == "down" and ray.killed == [(actor, True)]


def test_a_worker_ray_will_not_restart_goes_down(caplog):
    supervisor, actor, _, _, clock = setup()
    run(supervisor)
    slot = supervisor.slots[0]
    slot.pending = Ref(ray_exceptions.ActorUnavailableError("restarting", b"0" * 16))
    actor.script["identity"].append(ray_exceptions.ActorDiedError())
    run(supervisor)
    clock.now += RETRY_S
    run(supervisor)
    assert slot.state == "down" and "is down for good" in caplog.text


def test_fences_hit_only_the_process_the_verdict_is_about():
    supervisor, actor, ray, _, _ = setup()
    run(supervisor)
    assert not supervisor.fence(FenceWorker(0, 999, "no heartbeat"), may_restart=True)
    assert not supervisor.fence(FenceWorker(3, 101, "no heartbeat"), may_restart=True)
    assert supervisor.fence(FenceWorker(0, 101, "no heartbeat for 1.6s"), may_restart=True)
    assert ray.killed == [(actor, False)]  # Ray restarts it


def test_stop_all_stops_the_loops_then_kills_the_actors():
    supervisor, actor, ray, _, _ = setup()
    run(supervisor)
    supervisor.stop_all(1.0)
    assert ("stop", ()) in actor.calls and ray.killed == [(actor, True)]
    assert supervisor.slots[0].state == "stopped"
