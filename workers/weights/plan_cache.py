"""The weight-path plans measured on this machine (`weight-paths.json` beside the kernel builds):
one record per (CPU, torch, kernel source, thread count, weight type, shape, candidate paths),
saying the plan and where and how it was measured (thread count, CPU, when, how busy the
host was, a digest of the kernel source). Read-modify-write under the file's lock
(kernel_records.update_json), so workers that start together and measure different shapes all
keep theirs.
Owns: the records and the file. Does not own: measuring (path_plan.py) or the choice rule.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from workers.model.kernel_records import read_json, update_json
from workers.weights.path_plan import PathPlan

CACHE_VERSION = 11


@dataclass(frozen=True)
class PlanRecord:
    """A plan and what it was measured under: `threads` torch threads on `cpu`
    (kernel_records.cpu_name), at `measured_at` (unix seconds), while other processes used
    `others_busy` of the CPUs (kernel_records.BusyProbe)."""

    plan: PathPlan
    type_name: str
    shape: tuple[int, int]
    threads: int
    cpu: str
    measured_at: float = 0.0
    others_busy: float = 0.0
    source: str = ""
    """kernel_records.plan_source_digest() of the kernels it was measured on ("": unknown)."""

    def to_json(self) -> dict:
        return {"plan": [list(step) for step in self.plan.steps], "type": self.type_name,
                "shape": list(self.shape), "threads": self.threads, "cpu": self.cpu,
                "measured_at": round(self.measured_at), "others_busy": round(self.others_busy, 3),
                "source": self.source}

    @classmethod
    def from_json(cls, data: object) -> PlanRecord | None:
        """The record, or None for anything else (an older version's entry, a torn write)."""
        if not isinstance(data, dict):
            return None
        try:
            plan = PathPlan(tuple((int(rows), str(path)) for rows, path in data["plan"]))
            rows, cols = (int(v) for v in data["shape"])
            return cls(plan, str(data["type"]), (rows, cols), int(data["threads"]), str(data["cpu"]),
                       float(data.get("measured_at", 0.0)), float(data.get("others_busy", 0.0)),
                       str(data.get("source", "")))
        except (KeyError, TypeError, ValueError):
            return None


class PlanCache:
    """Measured plans in a JSON file beside the kernel builds, keyed by what they depend on:
    this CPU, torch, the kernel source, thread count, weight type, shape and the candidates."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def key(cpu: str, kernel_source: str, type_name: str, shape: tuple[int, int], paths: Sequence[str],
            threads: int | None = None) -> str:
        threads = torch.get_num_threads() if threads is None else threads
        text = "\0".join([cpu, torch.__version__, kernel_source, str(threads), type_name,
                          f"{shape[0]}x{shape[1]}", ",".join(paths), str(CACHE_VERSION)])
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, key: str) -> PlanRecord | None:
        return PlanRecord.from_json(read_json(self.path).get(key))

    def records(self) -> dict[str, PlanRecord]:
        """Every readable record, by key."""
        out = {key: PlanRecord.from_json(entry) for key, entry in read_json(self.path).items()}
        return {key: record for key, record in out.items() if record is not None}

    def put(self, key: str, record: PlanRecord) -> None:
        update_json(self.path, lambda entries: entries.__setitem__(key, record.to_json()))

    def drop(self, key: str) -> None:
        """Forget a record (it lost its check at start and what replaced it was not kept)."""
        update_json(self.path, lambda entries: entries.pop(key, None))
