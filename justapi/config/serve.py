"""`justapi serve` configuration: the per-concern dataclasses grouped, loaded from TOML + flags.

Keys are named as the CLI flags (`max-seqs` or `max_seqs`), flat, in one table; flags given on
the command line override the file. Unknown keys and bad values raise ConfigError naming the
key. Owns: the key -> (section, field) map and the server's own settings. Does not own: the
per-concern validation (justapi/config/sections.py).
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from typing import Any

from justapi.config.cluster import ClusterConfig
from justapi.config.ops import OpsConfig
from justapi.config.pd import PdConfig
from justapi.config.sections import CacheConfig, ConfigError, ModelConfig, SchedulerConfig, _require
from justapi.config.spec import SpecConfig
from justapi.scheduler.topology import ROLE_DECODE
from justapi.wire import transport

LAUNCHERS = ("local", "ray")
API_KEY_ENV = "JUSTAPI_API_KEY"
"""The HTTP API key reaches the frontend in its environment only (never a config or argv)."""


@dataclass(frozen=True)
class ServerConfig:
    """The process pool and its endpoints."""

    host: str = "127.0.0.1"
    """HTTP bind address (loopback unless told otherwise)."""
    port: int = 8000
    """HTTP port; 0 picks a free one."""
    zmq: str = ""
    """Endpoint of the ZMQ client API; "" puts an ipc socket in the runtime dir."""
    workers: int = 1
    """Worker processes (one per GPU with --gpu; CPU workers share the cores)."""
    threads: int = 0
    """torch threads of each CPU worker; 0: the cores divided among the workers (with PD:
    see ServeConfig.cpu_worker_threads)."""
    cpu_spin: int = -1
    """How long a CPU worker's OpenMP thread spins at a barrier before it sleeps, as
    GOMP_SPINCOUNT (10,000 is about 0.1-0.3 ms); 0: it sleeps at once; -1 (auto): 10,000 for
    models whose steps take far longer than the spin, 0 for tiny ones and where the workers'
    threads outnumber the cores (justapi/launch/launcher.py)."""
    served_model_name: str = ""
    """Model id shown by /v1/models; "" derives it from the GGUF."""
    ready_timeout_s: float = 120.0
    """How long the launcher waits for every process's Ready."""
    launcher: str = "local"
    """local | ray."""
    log_level: str = "info"
    """Log level of every process."""
    max_request_bytes: int = 4 << 20
    """HTTP request bodies larger than this are refused with 413."""
    max_queue: int = 1024
    """Requests admitted beyond what the workers run at once (max-seqs x workers); past that
    new requests get 429 with Retry-After."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, requests in flight get this long to finish (new ones get 503)."""
    log_requests: bool = False
    """Log prompts and parameters of each request (off: prompt text never reaches the logs)."""
    zmq_curve_secret_key: str = ""
    """File with the z85 CURVE secret key of the ZMQ client endpoint (needed for tcp beyond
    loopback)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.port, int) and 0 <= self.port <= 65535,
                 f"port must be in [0, 65535], got {self.port!r}")
        _require(isinstance(self.workers, int) and 1 <= self.workers <= 64,
                 f"workers must be in [1, 64], got {self.workers!r}")
        _require(isinstance(self.threads, int) and not isinstance(self.threads, bool)
                 and 0 <= self.threads <= 1024, f"threads must be in [0, 1024], got {self.threads!r}")
        _require(isinstance(self.cpu_spin, int) and not isinstance(self.cpu_spin, bool)
                 and -1 <= self.cpu_spin <= 10**9,
                 f"cpu-spin must be -1 (auto) or in [0, 1e9], got {self.cpu_spin!r}")
        _require(self.ready_timeout_s > 0, "ready-timeout-s must be > 0")
        _require(self.launcher in LAUNCHERS,
                 f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        _require(self.log_level in ("debug", "info", "warning", "error"),
                 f"log-level must be debug|info|warning|error, got {self.log_level!r}")
        _require(isinstance(self.max_request_bytes, int) and self.max_request_bytes >= 1024,
                 f"max-request-bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        _require(isinstance(self.max_queue, int) and self.max_queue >= 0,
                 f"max-queue must be an integer >= 0, got {self.max_queue!r}")
        _require(isinstance(self.shutdown_grace_s, (int, float)) and self.shutdown_grace_s >= 0,
                 f"shutdown-grace-s must be a number >= 0, got {self.shutdown_grace_s!r}")
        _require(isinstance(self.log_requests, bool),
                 f"log-requests must be true or false, got {self.log_requests!r}")
        _require(not self.zmq.startswith("tcp://") or transport.is_loopback_endpoint(self.zmq)
                 or bool(self.zmq_curve_secret_key),
                 f"zmq {self.zmq} is reachable beyond this host: it needs CURVE encryption, "
                 "give --zmq-curve-secret-key FILE (make a pair with tools/curve_keys.py)")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `justapi serve` needs; each process takes the slices it uses."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    pd: PdConfig = field(default_factory=PdConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    speculative: SpecConfig = field(default_factory=SpecConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def cpu_worker_threads(self, index: int, num_workers: int, cores: int) -> int:
        """torch threads of CPU worker `index`: its share of the cores (at least one). With
        PD, the prefill workers share all the cores (their steps are long, compute-bound
        chunks) and each decode worker takes one thread (its steps are small; it mostly waits
        for the next one). `threads` overrides both."""
        if self.server.threads:
            return self.server.threads
        if self.pd.is_enabled:
            return 1 if self.pd.role_of(index) == ROLE_DECODE else max(1, cores // self.pd.num_prefill)
        return max(1, cores // num_workers)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeConfig:
        return cls(**{name: section(**data.get(name, {}))
                      for name, section in _SECTION_TYPES.items()})


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "server": ServerConfig, "ops": OpsConfig, "pd": PdConfig, "speculative": SpecConfig,
    "cluster": ClusterConfig,
}


def _key_map() -> dict[str, tuple[str, str]]:
    """flag-style key -> (section, field name)."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            out[f.name.replace("_", "-")] = (section, f.name)
    return out


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> ServeConfig:
    """File values, then overrides (flags the user actually gave), into a validated config."""
    keys = _key_map()
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_TYPES}
    for source in (file_values, overrides):
        for raw_key, value in source.items():
            key = raw_key.replace("_", "-")
            if key not in keys:
                raise ConfigError(f"unknown config key {raw_key!r}")
            section, name = keys[key]
            sections[section][name] = value
    _apply_pd(sections)
    _check_cluster(sections)
    try:
        config = ServeConfig.from_dict(sections)
    except TypeError as exc:
        raise ConfigError(f"bad config value: {exc}") from None
    _check_spec(config)
    return config


def _check_spec(config: ServeConfig) -> None:
    """Speculative decoding runs colocated; a draft model's KV pool is the worker's own, so
    CPU workers (which share one target pool) are limited to one."""
    spec = config.speculative
    if not spec.is_enabled:
        return
    _require(not config.pd.is_enabled, f"spec={spec.spec!r} does not combine with pd={config.pd.pd!r}")
    _require(spec.spec != "draft" or config.model.device != "cpu" or config.server.workers == 1,
             f"draft-model on CPU needs workers = 1 (got {config.server.workers}): CPU workers "
             "share one KV pool and the draft's pool is per worker; use spec = 'ngram'")


def _check_cluster(sections: dict[str, dict[str, Any]]) -> None:
    """Cluster keys belong to launcher = "ray"; its KV pools are one per host (no PD side pools)."""
    is_ray = sections["server"].get("launcher", "local") == "ray"
    if sections["cluster"] and not is_ray:
        keys = ", ".join(k.replace("_", "-") for k in sorted(sections["cluster"]))
        raise ConfigError(f"{keys} need launcher = 'ray' (--launcher ray)")
    if is_ray and sections["pd"].get("pd_separate_pools"):
        raise ConfigError("pd-separate-pools does not apply to launcher = 'ray' (KV pools are "
                          "one per host; hand-offs between hosts always copy)")


def _apply_pd(sections: dict[str, dict[str, Any]]) -> None:
    """--pd P:D sets the worker count to P + D (an explicit, different --workers is an error)."""
    pd = PdConfig(**sections["pd"]) if sections["pd"] else PdConfig()
    if not pd.is_enabled:
        return
    workers = sections["server"].setdefault("workers", pd.num_workers)
    if workers != pd.num_workers:
        raise ConfigError(f"workers={workers} disagrees with pd={pd.pd!r} ({pd.num_workers} workers)")
    if sections["scheduler"].get("scheduled") is False:
        raise ConfigError("pd needs continuous batching (drop --no-scheduled)")


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"config {path}: keys must be flat (flag names), found table(s) {nested}")
    return data
