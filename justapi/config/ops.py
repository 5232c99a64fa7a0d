"""Operations settings of `justapi serve`: health thresholds, worker and scheduler restarts, the
admin socket, the KV events cluster routers subscribe to.

Keys are flat like every serve key (`restart-workers`, `step-timeout-s`, ...); see
docs/operations.md for what each one changes in practice.
Owns: those fields and their validation. Does not own: the health logic (justapi/health/table.py,
justapi/health/watch.py) or the restarts themselves (justapi/launch/supervisor.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from justapi.config.fields import ConfigError, check_bool, check_number, option, require
from justapi.wire import transport


@dataclass(frozen=True)
class OpsConfig:
    """How the pool watches its workers and what it does about a failed one."""

    restart_workers: bool = option(False, "Start a replacement for a worker that died or was "
                                          "fenced; it rejoins after its Ready.")
    max_restarts: int = option(5, "Most restarts of one worker slot within restart-window-s; "
                                  "past that it stays down.")
    restart_window_s: float = option(600.0, "The window max-restarts counts over.")
    restart_scheduler: bool = option(True, "Start a new scheduler when it dies; the workers "
                                           "stay, the frontend resubmits every open request "
                                           "and clients see a pause (max-restarts applies).")
    standby_scheduler: bool = option(True, "With restart-scheduler: keep a scheduler started "
                                           "ahead (imports and tokenizer loaded, ~80 MB) to "
                                           "take over at once instead of starting one then.")
    heartbeat_timeout_s: float = option(1.5, "A worker silent this long is unhealthy (workers "
                                             "beat every 0.5 s).")
    step_timeout_s: float = option(120.0, "A step in flight this long is hung (its worker is "
                                          "fenced even if it still beats); with unfinished "
                                          "requests and no step done for this long, the "
                                          "scheduler is not progressing.")
    thermal_hold_s: float = option(60.0, "A GPU at its thermal limit (slowdown temperature, "
                                         "thermal throttling) this long is fatal.")
    gpu_poll_interval_s: float = option(1.0, "How often the scheduler reads NVML.")
    admin: str = option("", "Admin socket endpoint for the ops commands (none: an ipc socket in "
                            "the runtime dir); tcp must be loopback.")
    kv_events: str = option("", "Publish vLLM-compatible KV cache events (BlockStored, "
                                "BlockRemoved, AllBlocksCleared; msgpack) on this ZeroMQ PUB "
                                "endpoint, e.g. tcp://*:5557, for llm-d / Dynamo routers "
                                "(docs/kv-events.md). none: off.")
    kv_events_replay: str = option("", "ROUTER endpoint where a reconnecting router asks for "
                                       "the batches it missed (e.g. tcp://*:5558); none: no "
                                       "replay.")
    kv_events_topic: str = option("", "Topic frame of every KV events message (vLLM's "
                                      "kv_events_config topic).")
    kv_events_hash_seed: str = option("", "Seed of the block hashes (vLLM's PYTHONHASHSEED): a "
                                          "router that hashes prompts itself must use the same. "
                                          "none: PYTHONHASHSEED from the environment, else 0.")

    def __post_init__(self) -> None:
        check_bool(self.restart_workers, "restart-workers")
        check_bool(self.restart_scheduler, "restart-scheduler")
        check_bool(self.standby_scheduler, "standby-scheduler")
        check_number(self.max_restarts, "max-restarts", low=0, integer=True)
        check_number(self.restart_window_s, "restart-window-s", low=1.0)
        check_number(self.heartbeat_timeout_s, "heartbeat-timeout-s", low=0.6)
        check_number(self.step_timeout_s, "step-timeout-s", low=1.0)
        check_number(self.thermal_hold_s, "thermal-hold-s", low=0.0)
        check_number(self.gpu_poll_interval_s, "gpu-poll-interval-s", low=0.1)
        _check_admin_endpoint(self.admin)
        for name in ("kv_events", "kv_events_replay"):
            endpoint = getattr(self, name)
            require(isinstance(endpoint, str) and (not endpoint or endpoint.startswith(
                ("tcp://", "ipc://", "inproc://"))),
                f"{name.replace('_', '-')} must be a tcp://, ipc:// or inproc:// endpoint, "
                f"got {endpoint!r}")
        require(not self.kv_events_replay or bool(self.kv_events),
                "kv-events-replay needs kv-events")

    def kv_events_seed(self) -> str:
        """The block hash seed: kv-events-hash-seed, else PYTHONHASHSEED, else "0"."""
        return self.kv_events_hash_seed or os.environ.get("PYTHONHASHSEED", "") or "0"


def _check_admin_endpoint(endpoint: object) -> None:
    if not isinstance(endpoint, str):
        raise ConfigError(f"admin must be a ZMQ endpoint string, got {endpoint!r}")
    if not endpoint:
        return
    require(endpoint.startswith(("ipc://", "tcp://")),
            f"admin must be an ipc:// or tcp:// endpoint, got {endpoint!r}")
    # The admin socket drains workers and flushes caches without authentication: loopback only.
    require(transport.is_loopback_endpoint(endpoint),
            f"admin must be ipc:// or a loopback tcp:// address, got {endpoint!r}")
