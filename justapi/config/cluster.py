"""Scale-out settings of `justapi serve --launcher ray`: the Ray cluster, the scheduler's worker
endpoint, placement, and what moving KV between hosts costs the router.

Keys are flat like every serve key (`address`, `node-ip`, `worker-port`, `cpus-per-worker`,
`placement`, `cross-host-copy-cost`); docs/scale-out.md says what each one changes.
Owns: those fields and their validation. Does not own: Ray (justapi/cluster/placement.py), the
wire (justapi/wire/auth.py, justapi/cluster/kv_relay.py) or routing (justapi/scheduler/).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from justapi.config.sections import _require

PLACEMENTS = ("spread", "pack", "strict_spread", "strict_pack")


def _number_in(value: object, low: float, high: float, key: str) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(is_number and low <= value <= high,  # type: ignore[operator]
             f"{key} must be a number in [{low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """Workers on other hosts (launcher = "ray")."""

    address: str = ""
    """Ray cluster address HOST:PORT ("" = Ray's own discovery: RAY_ADDRESS or a local cluster)."""
    node_ip: str = ""
    """This host's address in the cluster: the scheduler's worker endpoint binds it ("" = the
    address Ray detects)."""
    worker_port: int = 0
    """TCP port of the scheduler's worker endpoint (0 picks a free one)."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each CPU worker (its torch threads); GPU workers take one GPU."""
    placement: str = "spread"
    """Ray placement-group strategy for the workers: spread | pack | strict_spread | strict_pack."""
    cross_host_copy_cost: float = 0.2
    """Cost of copying one token's KV from another host, as a fraction of computing it: the
    router imports a cached prefix from another host when this is below 1, never at 1 or above."""

    def __post_init__(self) -> None:
        _require(isinstance(self.address, str)
                 and (not self.address or _is_host_port(self.address)),
                 f"address must be HOST:PORT (the Ray cluster), got {self.address!r}")
        _require(isinstance(self.node_ip, str) and (not self.node_ip or _is_ip(self.node_ip)),
                 f"node-ip must be an IP address, got {self.node_ip!r}")
        _require(isinstance(self.worker_port, int) and not isinstance(self.worker_port, bool)
                 and 0 <= self.worker_port <= 65535,
                 f"worker-port must be in [0, 65535], got {self.worker_port!r}")
        _number_in(self.cpus_per_worker, 0.01, 1024, "cpus-per-worker")
        _require(self.placement in PLACEMENTS,
                 f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        _number_in(self.cross_host_copy_cost, 0.0, 1e6, "cross-host-copy-cost")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) <= 65535
