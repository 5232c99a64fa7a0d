"""`justapi serve` configuration: one ServeConfig of frozen sections, loaded from TOML + flags.

Keys are the sections' field names spelled as flags (`max-seqs`; `max_seqs` works too), flat,
in one table; flags given on the command line override the file. Unknown keys and bad values
raise ConfigError naming the key. Owns: the sections' grouping, the key -> (section, field)
map and the checks across sections. Does not own: each section's fields and validation
(sections.py, ops.py, pd.py, spec.py, cluster.py) or the flags (flags.py).
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from typing import Any

from justapi.config.cluster import ClusterConfig
from justapi.config.fields import ConfigError, flag_name, require
from justapi.config.ops import OpsConfig
from justapi.config.pd import PdConfig
from justapi.config.sections import (
    CacheConfig,
    ModelConfig,
    SamplingConfig,
    SchedulerConfig,
    ServerConfig,
)
from justapi.config.spec import SpecConfig
from justapi.scheduler.topology import ROLE_DECODE

API_KEY_ENV = "JUSTAPI_API_KEY"
"""The HTTP API key reaches the frontend in its environment only (never a config or argv)."""
AUTO_DECODE_STEPS = 4
"""decode-steps under auto where CPU workers' threads take every core (docs/runtime.md)."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything `justapi serve` needs; each process takes the slices it uses."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
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

    def local_cpu_threads(self, cores: int) -> int | None:
        """The torch threads of all local CPU workers together; None for GPU workers and
        workers on other hosts (they take no core from the frontend and the scheduler)."""
        if self.model.device != "cpu" or self.server.launcher != "local":
            return None
        workers = self.server.workers
        return sum(self.cpu_worker_threads(i, workers, cores) for i in range(workers))

    def overlaps_steps(self, cores: int) -> bool:
        """Whether a worker's next step is planned while its current one runs. GPU workers (and
        workers on other hosts) overlap as configured; local CPU workers only with a core to
        spare beyond their threads: otherwise the scheduler's planning takes a core from the
        very step it overlaps (2 vCPUs, SmolLM2: overlap cost 8-9% of served tok/s at 1 and 16
        streams, docs/bench.md)."""
        threads = self.local_cpu_threads(cores)
        return self.scheduler.overlap and (threads is None or threads < cores)

    def decode_steps_for(self, cores: int) -> int:
        """Steps a multi-step plan may run. Auto: AUTO_DECODE_STEPS where local CPU workers'
        threads take every core - the round trip between steps is not hidden by overlap there,
        and each step's control-plane work takes a core from the next (docs/runtime.md) - else
        1 (off)."""
        if self.scheduler.decode_steps >= 1:
            return self.scheduler.decode_steps
        threads = self.local_cpu_threads(cores)
        return AUTO_DECODE_STEPS if threads is not None and threads >= cores else 1

    def control_niceness(self, cores: int) -> int:
        """The niceness the frontend and the scheduler take. Auto: 10 where local CPU workers'
        threads take every core. Their work beside a running step (a stream's deltas, HTTP)
        otherwise preempts one of the worker's threads, and the step's next OpenMP barrier
        waits for it (docs/runtime.md); niced, they take the gaps between steps instead."""
        if self.server.control_nice >= 0:
            return self.server.control_nice
        threads = self.local_cpu_threads(cores)
        return 10 if threads is not None and threads >= cores else 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeConfig:
        return cls(**{name: section(**data.get(name, {}))
                      for name, section in SECTION_TYPES.items()})


SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "server": ServerConfig, "sampling": SamplingConfig, "ops": OpsConfig, "pd": PdConfig,
    "speculative": SpecConfig, "cluster": ClusterConfig,
}
"""ServeConfig's sections by attribute name, in the order --help lists their flags."""


def key_map() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every config key (flag spelling) -> (section, field). Field names are unique across
    sections, so one flat table of keys names each field once."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            key = flag_name(f.name)
            assert key not in out, f"config key {key} is in two sections"
            out[key] = (section, f)
    return out


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> ServeConfig:
    """File values, then overrides (flags the user actually gave), into a validated config."""
    keys = key_map()
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
    for source in (file_values, overrides):
        for raw_key, value in source.items():
            key = raw_key.replace("_", "-")
            if key not in keys:
                raise ConfigError(f"unknown config key {raw_key!r}")
            section, f = keys[key]
            sections[section][f.name] = value
    _apply_pd(sections)
    _check_cluster(sections)
    try:
        config = ServeConfig.from_dict(sections)
    except TypeError as exc:
        raise ConfigError(f"bad config value: {exc}") from None
    _check_spec(config)
    config.cache.pool_dtype(config.model.device)  # float32 on GPUs: a ConfigError now
    return config


def _check_spec(config: ServeConfig) -> None:
    """Speculative decoding runs colocated; a draft model's KV pool is the worker's own, so
    CPU workers (which share one target pool) are limited to one."""
    spec = config.speculative
    if not spec.is_enabled:
        return
    require(not config.pd.is_enabled,
            f"spec={spec.spec!r} does not combine with pd={config.pd.pd!r}")
    require(spec.spec != "draft" or config.model.device != "cpu" or config.server.workers == 1,
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
