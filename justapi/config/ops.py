"""Operations settings of `justapi serve`: health thresholds, worker restarts, the admin socket.

Keys are flat like every serve key (`restart-workers`, `step-timeout-s`, ...); see
docs/operations.md for what each one changes in practice.
Owns: those fields and their validation. Does not own: the health logic (justapi/health/table.py,
justapi/health/watch.py) or the restarts themselves (justapi/launch/supervisor.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from justapi.config.sections import ConfigError, _require
from justapi.wire import transport


def _number_at_least(value: object, minimum: float, key: str) -> None:
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum,
             f"{key} must be a number >= {minimum:g}, got {value!r}")


@dataclass(frozen=True)
class OpsConfig:
    """How the pool watches its workers and what it does about a failed one."""

    restart_workers: bool = False
    """Start a replacement for a worker that died or was fenced; it rejoins after its Ready."""
    max_restarts: int = 5
    """Most restarts of one worker slot within restart_window_s; past that it stays down."""
    restart_window_s: float = 600.0
    """The window max_restarts counts over."""
    heartbeat_timeout_s: float = 1.5
    """A worker silent this long is unhealthy (workers beat every 0.5 s)."""
    step_timeout_s: float = 120.0
    """A step in flight this long is hung (its worker is fenced even if it still beats); with
    unfinished requests and no step done for this long, the scheduler is not progressing."""
    thermal_hold_s: float = 60.0
    """A GPU at its thermal limit (slowdown temperature, thermal throttling) this long is fatal."""
    gpu_poll_interval_s: float = 1.0
    """How often the scheduler reads NVML."""
    admin: str = ""
    """Admin socket endpoint; "" puts an ipc socket in the runtime dir. tcp must be loopback."""

    def __post_init__(self) -> None:
        _require(isinstance(self.restart_workers, bool),
                 f"restart-workers must be true or false, got {self.restart_workers!r}")
        _require(isinstance(self.max_restarts, int) and not isinstance(self.max_restarts, bool)
                 and self.max_restarts >= 0,
                 f"max-restarts must be an integer >= 0, got {self.max_restarts!r}")
        _number_at_least(self.restart_window_s, 1.0, "restart-window-s")
        _number_at_least(self.heartbeat_timeout_s, 0.6, "heartbeat-timeout-s")
        _number_at_least(self.step_timeout_s, 1.0, "step-timeout-s")
        _number_at_least(self.thermal_hold_s, 0.0, "thermal-hold-s")
        _number_at_least(self.gpu_poll_interval_s, 0.1, "gpu-poll-interval-s")
        _check_admin_endpoint(self.admin)


def _check_admin_endpoint(endpoint: object) -> None:
    if not isinstance(endpoint, str):
        raise ConfigError(f"admin must be a ZMQ endpoint string, got {endpoint!r}")
    if not endpoint:
        return
    _require(endpoint.startswith(("ipc://", "tcp://")),
             f"admin must be an ipc:// or tcp:// endpoint, got {endpoint!r}")
    # The admin socket drains workers and flushes caches without authentication: loopback only.
    _require(transport.is_loopback_endpoint(endpoint),
             f"admin must be ipc:// or a loopback tcp:// address, got {endpoint!r}")
