"""The scheduler core: pure, deterministic continuous batching over paged KV pools.

No torch, sockets or clocks: the scheduler process (justapi/scheduler/process.py) feeds it
messages and sends out what it returns. See docs/scheduler.md for the design.
"""
from justapi.scheduler.scheduler import Scheduler
from justapi.scheduler.topology import ModelLimits, PoolSpec, Topology, WorkerSpec

__all__ = ["ModelLimits", "PoolSpec", "Scheduler", "Topology", "WorkerSpec"]
