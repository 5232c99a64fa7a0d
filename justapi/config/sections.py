"""Configuration: frozen dataclasses, one per concern, validated in __post_init__.

Each component receives only its slice. Values found at run time (how many blocks a worker
could allocate) travel in messages, never by mutating these objects.
Owns: field names, defaults and validation. Does not own: TOML/CLI loading (justapi/cli.py).
"""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority", "lpm")
DEVICES = ("cpu", "cuda")
WEIGHT_MODES = ("fp32", "bf16", "q4", "auto")


class ConfigError(ValueError):
    """A configuration value that is out of range or unknown; the message names the key."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{name.replace('_', '-')} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """KV memory: how the pool is cut into blocks."""

    block_size: int = 16
    """Tokens per KV block."""
    pool_blocks: int = 0
    """Blocks per device pool; 0 sizes the pool from available memory."""
    kv_memory_fraction: float = 0.25
    """With pool_blocks=0: fraction of free memory (RAM on CPU, GPU memory on CUDA) for KV."""
    enable_prefix_cache: bool = True
    """Share full blocks of identical prefixes between requests (radix tree)."""

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        _require(self.block_size <= 1024 and self.block_size & (self.block_size - 1) == 0,
                 f"block-size must be a power of two <= 1024, got {self.block_size!r}")
        _require(isinstance(self.pool_blocks, int) and self.pool_blocks >= 0,
                 f"pool-blocks must be an integer >= 0, got {self.pool_blocks!r}")
        _require(0.0 < self.kv_memory_fraction <= 0.95,
                 f"kv-memory-fraction must be in (0, 0.95], got {self.kv_memory_fraction!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching budgets and policy of the scheduler core."""

    max_seqs: int = 32
    """Most requests in one step."""
    max_prefill: int = 4
    """Most requests mid-prefill in one step."""
    max_decode: int = 32
    """Most decoding requests in one step."""
    chunk_size: int = 512
    """Most prompt tokens computed for one request in one step (chunked prefill)."""
    max_batched_tokens: int = 2048
    """Token budget of one step (all sequences' chunks together)."""
    policy: str = "fcfs"
    """Waiting-queue order: fcfs | priority | lpm (longest cached prefix first)."""
    scheduled: bool = True
    """True: continuous batching; False: static batching (the benchmark baseline)."""
    lpm_max_waiting: int = 128
    """lpm orders by cached prefix only while at most this many requests wait; above, FCFS."""
    lpm_max_wait_steps: int = 256
    """lpm: a request waiting more steps than this is admitted first (FCFS), so none starves."""
    route_balance_abs: int = 8
    """Routing: the longest-cached-prefix pool is skipped when its load exceeds the lightest
    pool's by more than this many requests per worker..."""
    route_balance_rel: float = 1.5
    """...and by more than this factor (SGLang's cache_aware balance thresholds)."""

    def __post_init__(self) -> None:
        _positive(self, "max_seqs", "max_prefill", "max_decode", "chunk_size", "max_batched_tokens",
                  "lpm_max_waiting", "lpm_max_wait_steps", "route_balance_abs")
        _require(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        _require(isinstance(self.route_balance_rel, (int, float))
                 and not isinstance(self.route_balance_rel, bool) and self.route_balance_rel >= 1.0,
                 f"route-balance-rel must be a number >= 1, got {self.route_balance_rel!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model and how the worker holds it."""

    model: str = ""
    """Path to a GGUF file; "" for the embedded default; "synthetic:..." for random weights."""
    device: str = "cpu"
    """cpu | cuda."""
    weights: str = "fp32"
    """fp32 | q4 | auto: how quantized GGUF tensors are held and computed."""
    max_context: int = 0
    """Context length cap; 0 takes the model's own."""

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(self.weights in WEIGHT_MODES,
                 f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        _require(isinstance(self.max_context, int) and self.max_context >= 0,
                 f"max-context must be an integer >= 0, got {self.max_context!r}")
