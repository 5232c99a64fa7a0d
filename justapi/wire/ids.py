"""Names and periods that two processes must agree on, each defined once.

A worker's two DEALER sockets carry routing identities `worker-N` (steps, copies) and
`worker-N-heartbeat` (its heartbeat thread) on the scheduler's ROUTER; `worker-N` is also
the name its CURVE key is admitted as (auth.py). Workers beat every HEARTBEAT_INTERVAL_S;
the scheduler's health table measures its timeouts against that period.
Owns: those names and that period. Does not own: messages (protocol.py), timeouts (OpsConfig).
"""
from __future__ import annotations

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_SUFFIX = "-heartbeat"


def worker_name(worker_id: int) -> str:
    """'worker-3': worker 3's routing identity, and the name its CURVE key is admitted as."""
    return f"worker-{worker_id}"


def worker_identity(worker_id: int) -> bytes:
    """The routing identity of worker `worker_id`'s step socket."""
    return worker_name(worker_id).encode()


def heartbeat_identity(worker_id: int) -> bytes:
    """The routing identity of worker `worker_id`'s heartbeat socket."""
    return (worker_name(worker_id) + HEARTBEAT_SUFFIX).encode()
