"""What every child process of the pool shares: its spec, its start-up and its death rules.

A child is started as `python -m <module> <spec-json>`; it dies with the launcher
(PR_SET_PDEATHSIG), leaves SIGINT to the launcher (which stops the pool in order), turns
SIGTERM into a stop flag, and reports Ready/Failed on the launcher's control socket.
Owns: the spec format and the child-side start-up protocol. Does not own: any role's work.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq

from justapi.config.serve import ServeConfig
from justapi.wire import transport
from justapi.wire.protocol import ProcessFailed, ProcessReady

_PR_SET_PDEATHSIG = 1
CONTROL_ROLES = ("frontend", "scheduler")
"""Processes that serve requests beside the workers, niced by `control_niceness`."""


@dataclass(frozen=True)
class Endpoints:
    """Every socket address of one deployment (ipc:// paths in the private runtime dir)."""

    runtime_dir: str
    scheduler_in: str
    frontend_in: str
    workers: str
    admin: str
    control: str
    client: str

    @classmethod
    def in_dir(cls, runtime_dir: str, client: str = "", admin: str = "") -> Endpoints:
        def ep(name: str) -> str:
            return transport.ipc_endpoint(runtime_dir, name)

        return cls(runtime_dir=runtime_dir, scheduler_in=ep("scheduler"), frontend_in=ep("frontend"),
                   workers=ep("workers"), admin=admin or ep("admin"), control=ep("control"),
                   client=client or ep("client"))


@dataclass(frozen=True)
class ChildSpec:
    """What the launcher tells one child (JSON on its command line)."""

    role: str
    index: int
    config: ServeConfig
    endpoints: Endpoints
    model_path: str
    pool: dict[str, Any] = field(default_factory=dict)
    """Shared KV pool description on CPU (shm name, num_blocks, ...); {} when workers allocate."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        data = json.loads(text)
        data["config"] = ServeConfig.from_dict(data["config"])
        data["endpoints"] = Endpoints(**data["endpoints"])
        return cls(**data)


class StopFlag:
    """Set by SIGTERM; the role's loop checks it between steps."""

    def __init__(self) -> None:
        self.is_set = False

    def set(self, *_: object) -> None:
        self.is_set = True


def start_child(argv: list[str] | None = None) -> tuple[ChildSpec, StopFlag]:
    """Parse the spec, set logging and signal rules. Call first thing in a child's main."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m <role module> <spec-json> (started by `justapi serve`)")
    spec = ChildSpec.from_json(args[0])
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop.set)
    if spec.role in CONTROL_ROLES:
        niceness = spec.config.control_niceness(os.cpu_count() or 1)
        if niceness:
            os.nice(niceness)
    level = getattr(logging, spec.config.server.log_level.upper())
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {spec.role}{spec.index} %(levelname)s %(name)s: %(message)s")
    return spec, stop


def report(spec: ChildSpec, *, error: str | None = None, info: dict | None = None) -> None:
    """Tell the launcher this child is ready (or failed to start)."""
    context: zmq.Context = zmq.Context.instance()
    sock = transport.make_socket(context, zmq.PUSH, spec.endpoints.control, bind=False)
    sock.setsockopt(zmq.LINGER, 2000)
    if error is None:
        message: Any = ProcessReady(spec.role, spec.index, os.getpid(), info or {})
    else:
        message = ProcessFailed(spec.role, spec.index, os.getpid(), error)
    transport.send(sock, message)
    sock.close()


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
