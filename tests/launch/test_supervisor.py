"""Worker restarts: off by default, each exit handled once, a crash loop stops at
max-restarts within the window, and the budget comes back as the window slides. Scheduler
restarts: on by default, under the same budget, never for a scheduler told to stop."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from justapi.config.ops import OpsConfig
from justapi.launch.supervisor import SchedulerSupervisor, WorkerSupervisor, describe_exit


@dataclass
class FakeProcess:
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class FakeChild:
    role: str
    index: int
    process: FakeProcess


class Pool:
    """The launcher's side: respawn replaces a dead child with a new live one."""

    def __init__(self) -> None:
        self.next_pid = 100
        self.children = [FakeChild("scheduler", 0, FakeProcess(1)),
                         FakeChild("worker", 0, FakeProcess(2)), FakeChild("worker", 1, FakeProcess(3))]
        self.respawned: list[int] = []

    def respawn(self, child: FakeChild) -> None:
        self.children.remove(child)
        self.next_pid += 1
        self.children.append(FakeChild("worker", child.index, FakeProcess(self.next_pid)))
        self.respawned.append(child.index)

    def kill(self, index: int, code: int = -9) -> None:
        next(c for c in self.children if c.role == "worker" and c.index == index
             and c.process.returncode is None).process.returncode = code


def test_without_restart_workers_a_dead_worker_is_logged_once(caplog: pytest.LogCaptureFixture):
    pool = Pool()
    supervisor = WorkerSupervisor(OpsConfig(), pool.respawn)
    pool.kill(1)
    pool.children[0].process.returncode = 3  # the launcher, not the supervisor, handles these
    with caplog.at_level(logging.INFO, logger="justapi.launch.supervisor"):
        supervisor.check(pool.children)
        supervisor.check(pool.children)
    assert pool.respawned == []
    assert [r.getMessage() for r in caplog.records] == [
        "worker 1 (pid 3) exited with signal SIGKILL; not restarted: restart-workers is off"]


def test_restarts_stop_at_max_restarts_within_the_window():
    now = [0.0]
    pool = Pool()
    supervisor = WorkerSupervisor(OpsConfig(restart_workers=True, max_restarts=2,
                                            restart_window_s=60.0), pool.respawn, lambda: now[0])
    for _ in range(3):
        pool.kill(0)
        supervisor.check(pool.children)
        now[0] += 10.0
    assert pool.respawned == [0, 0]  # the third exit is past the budget
    assert supervisor.may_restart(0) == (False, "2 restart(s) in the last 60s (max-restarts 2)")
    assert supervisor.may_restart(1)[0]  # budgets are per slot
    now[0] = 61.0  # the first restart left the window
    assert supervisor.may_restart(0) == (True, "restart 2 of at most 2 in 60s")


def test_a_dead_scheduler_is_restarted_within_the_budget(caplog: pytest.LogCaptureFixture):
    now = [0.0]
    supervisor = SchedulerSupervisor(OpsConfig(max_restarts=2, restart_window_s=60.0),
                                     lambda: now[0])
    with caplog.at_level(logging.INFO, logger="justapi.launch.supervisor"):
        verdicts = []
        for pid in (10, 11, 12):
            verdicts.append(supervisor.on_exit(pid, -9))
            now[0] += 10.0
    assert verdicts == [True, True, False] and supervisor.num_restarts == 2
    assert caplog.records[-1].getMessage() == (
        "the scheduler (pid 12) exited with signal SIGKILL; not restarted: 2 restart(s) in the "
        "last 60s (max-restarts 2)")
    now[0] = 71.0  # the first restart left the window
    assert supervisor.on_exit(13, 1)


def test_a_scheduler_that_stopped_or_restarts_off_is_not_restarted():
    assert not SchedulerSupervisor(OpsConfig()).on_exit(10, 0)  # told to stop (SIGTERM)
    assert not SchedulerSupervisor(OpsConfig(restart_scheduler=False)).on_exit(10, -9)


@pytest.mark.parametrize("code,text", [(0, "code 0"), (1, "code 1"), (-9, "signal SIGKILL"),
                                       (-15, "signal SIGTERM"), (-200, "signal 200")])
def test_describe_exit(code: int, text: str):
    assert describe_exit(code) == text
