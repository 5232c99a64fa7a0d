"""Prompts and reference outputs shared by the scheduler tests that drive the real core
through justapi.scheduler.sim.harness over a V-token fake model."""
from __future__ import annotations

from justapi.scheduler.sim.fake_model import ReferenceModel
from justapi.scheduler.sim.harness import Harness

V = 64
REF = ReferenceModel(V)


def prompt(n: int, base: int = 2, stride: int = 5) -> list[int]:
    return [base + (i * stride) % (V - base) for i in range(n)]


def reference(p: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the fake model, no stop ids, far from any length cap."""
    return REF.generate(p, max_tokens, frozenset(), 10_000)[0]


def in_use(h: Harness) -> int:
    return int(h.scheduler.stats()["kv_blocks_in_use"])
