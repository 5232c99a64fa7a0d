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

from justapi.config.fields import check_choice, check_number, option, require

PLACEMENTS = ("spread", "pack", "strict_spread", "strict_pack")


@dataclass(frozen=True)
class ClusterConfig:
    """Workers on other hosts (launcher = "ray")."""

    address: str = option("", "Ray cluster address HOST:PORT (none: Ray's own discovery, "
                              "RAY_ADDRESS or a local cluster); --launcher ray.")
    node_ip: str = option("", "This host's address in the Ray cluster: the scheduler's worker "
                              "endpoint binds it (none: the address Ray detects).")
    worker_port: int = option(0, "TCP port of the scheduler's worker endpoint (0 picks a free "
                                 "one); --launcher ray.")
    cpus_per_worker: float = option(1.0, "CPUs Ray reserves for each CPU worker (its torch "
                                         "threads); GPU workers take one GPU.")
    placement: str = option("spread", "Ray placement-group strategy for the workers.",
                            choices=PLACEMENTS)
    cross_host_copy_cost: float = option(0.2, "Cost of copying one token's KV from another "
                                              "host, as a fraction of computing it: the router "
                                              "imports a cached prefix from another host when "
                                              "this is below 1, never at 1 or above.")

    def __post_init__(self) -> None:
        require(isinstance(self.address, str)
                and (not self.address or _is_host_port(self.address)),
                f"address must be HOST:PORT (the Ray cluster), got {self.address!r}")
        require(isinstance(self.node_ip, str) and (not self.node_ip or _is_ip(self.node_ip)),
                f"node-ip must be an IP address, got {self.node_ip!r}")
        check_number(self.worker_port, "worker-port", low=0, high=65535, integer=True)
        check_number(self.cpus_per_worker, "cpus-per-worker", low=0.01, high=1024)
        check_choice(self.placement, "placement", PLACEMENTS)
        check_number(self.cross_host_copy_cost, "cross-host-copy-cost", low=0.0, high=1e6)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) <= 65535
