"""Client side of the scheduler's admin socket, for the ops commands (justapi/ops/) and tests.

One request, one reply: a DEALER socket sends a command (justapi/wire/protocol.py, admin section)
and waits up to `timeout_s` for its StatusReply or AdminReply. With no endpoint given, the
most recently started live server of this user is found through its state file
(justapi/launch/discovery.py).
Owns: the request/reply exchange and its errors. Does not own: the commands' meaning
(justapi/scheduler/admin.py) or how the commands print them.
"""
from __future__ import annotations

import os
from typing import Any

import zmq

from justapi.launch import discovery
from justapi.wire import transport
from justapi.wire.codec import ProtocolError
from justapi.wire.protocol import (
    AdminReply,
    CheckInvariants,
    DrainWorker,
    FlushPrefixCache,
    QueryStatus,
    StatusReply,
)

DEFAULT_TIMEOUT_S = 5.0


class AdminError(RuntimeError):
    """The server could not be found or did not answer; one readable line."""


class AdminClient:
    def __init__(self, endpoint: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        try:
            self.endpoint = endpoint or discovery.default_admin_endpoint()
        except discovery.DiscoveryError as exc:
            raise AdminError(str(exc)) from None
        _check_reachable(self.endpoint)
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = transport.make_socket(self._context, zmq.DEALER, self.endpoint, bind=False)

    def request(self, command: Any) -> Any:
        """Send one command and return its reply (StatusReply or AdminReply)."""
        transport.send(self._socket, command)
        if not self._socket.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            raise AdminError(f"no answer from the admin socket {self.endpoint} in "
                             f"{self.timeout_s:g}s (is the server running and not stuck?)")
        try:
            _, reply = transport.recv(self._socket)
        except ProtocolError as exc:
            raise AdminError(f"malformed reply from {self.endpoint}: {exc}") from None
        return reply

    def status(self) -> StatusReply:
        return self._expect(self.request(QueryStatus()), StatusReply)

    def drain(self, worker_id: int, is_draining: bool = True) -> AdminReply:
        return self._expect(self.request(DrainWorker(worker_id, is_draining)), AdminReply)

    def flush_prefix_cache(self, pool_id: int = -1) -> AdminReply:
        return self._expect(self.request(FlushPrefixCache(pool_id)), AdminReply)

    def check_invariants(self) -> AdminReply:
        return self._expect(self.request(CheckInvariants()), AdminReply)

    def _expect(self, reply: Any, kind: type) -> Any:
        if isinstance(reply, kind):
            return reply
        if isinstance(reply, AdminReply):  # an error answer to a status query
            raise AdminError(reply.message)
        raise AdminError(f"unexpected {type(reply).__name__} from {self.endpoint}")

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_reachable(endpoint: str) -> None:
    """ZMQ connects lazily and would just time out: say at once when an ipc socket is absent."""
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):]):
        raise AdminError(f"no admin socket at {endpoint} (is the server running?)")
