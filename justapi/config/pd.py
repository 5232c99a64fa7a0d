"""Prefill/decode disaggregation settings of `justapi serve` (`--pd P:D`), and the worker layout
they imply.

Workers [0, P) prefill, workers [P, P + D) decode. On CPU every worker maps one shared KV
segment (zero-copy hand-off) unless `pd-separate-pools`, which gives the prefill workers pool 0
and the decode workers pool 1 (hand-off by copy, as between GPUs). See docs/pd.md.
Owns: those fields, their validation and the index -> role / pool rules. Does not own: the
scheduling (justapi/scheduler/pd/scheduler.py) or the segments (justapi/launch/shm_pool.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from justapi.config.fields import check_bool, check_number, option, require
from justapi.scheduler.topology import ROLE_DECODE, ROLE_PREFILL

MAX_PER_SIDE = 32
_PD_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class PdConfig:
    """Prefill/decode disaggregation."""

    pd: str = option("", "Prefill/decode disaggregation: P prefill and D decode workers, e.g. "
                         "1:1 (sets workers to P + D); none: colocated (every worker does both).")
    pd_separate_pools: bool = option(False, "CPU: a KV segment per PD side, so the hand-off "
                                            "copies blocks (as between GPUs); else one shared "
                                            "segment (zero-copy hand-off).",
                                     decls=("--pd-separate-pools/--pd-shared-pool",))
    pd_lease_s: float = option(30.0, "A hand-off not claimed by a decode worker in this time is "
                                     "taken back (recompute).")

    def __post_init__(self) -> None:
        require(isinstance(self.pd, str), f"pd must be a string like '1:1', got {self.pd!r}")
        if self.pd:
            match = _PD_RE.match(self.pd)
            require(match is not None, f"pd must look like P:D (e.g. 1:1), got {self.pd!r}")
            assert match is not None
            counts = int(match.group(1)), int(match.group(2))
            require(all(1 <= n <= MAX_PER_SIDE for n in counts),
                    f"pd needs 1..{MAX_PER_SIDE} workers per side, got {self.pd!r}")
        check_bool(self.pd_separate_pools, "pd-separate-pools")
        require(not self.pd_separate_pools or bool(self.pd),
                "pd-separate-pools needs pd (e.g. --pd 1:1)")
        check_number(self.pd_lease_s, "pd-lease-s", above=0.0)

    @property
    def is_enabled(self) -> bool:
        return bool(self.pd)

    @property
    def num_prefill(self) -> int:
        return int(self.pd.split(":")[0]) if self.pd else 0

    @property
    def num_decode(self) -> int:
        return int(self.pd.split(":")[1]) if self.pd else 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    def role_of(self, worker_index: int) -> str:
        """prefill for workers [0, P), decode for [P, P + D)."""
        if not 0 <= worker_index < self.num_workers:
            raise ValueError(f"worker {worker_index} is outside the --pd {self.pd} layout")
        return ROLE_PREFILL if worker_index < self.num_prefill else ROLE_DECODE

    def cpu_pool_of(self, worker_index: int) -> int:
        """The CPU KV segment a worker maps: 0, or 1 for decode workers with separate pools."""
        if not self.pd_separate_pools:
            return 0
        return int(self.role_of(worker_index) == ROLE_DECODE)
