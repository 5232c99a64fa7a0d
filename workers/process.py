"""The worker process: loads the model, maps its KV pool, runs the steps the scheduler plans.

CPU workers map the launcher's shared-memory pool (all CPU workers share one pool, or with
--pd-separate-pools one per side); a GPU worker allocates its own pool on its device and
exports a CUDA IPC handle in its Ready. A PD decode worker also executes CopyBlocks orders.
A heartbeat thread (own socket) reports every HEARTBEAT_INTERVAL_S with process figures.
A restarted scheduler attaches to it (AttachWorker): it drops the dead scheduler's orders
still queued, forgets every request and sends its Ready again.
Where it runs is a link passed in (link.py): a process the launcher started here
(LocalLink, this module's main) or a Ray actor on some host (RayLink).
Owns: its model, its ModelRunner state, its sockets. Does not own: which blocks hold what.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq

from justapi.config.spec import SpecConfig
from justapi.launch.child import ChildSpec, StopFlag, report, start_child
from justapi.launch.memory_limits import available_memory_bytes
from justapi.model.gguf_file import GGUFFile
from justapi.ops.timeline import Timeline
from justapi.wire import transport
from justapi.wire.codec import ProtocolError
from justapi.wire.ids import HEARTBEAT_INTERVAL_S, heartbeat_identity, worker_identity
from justapi.wire.protocol import (
    AttachWorker,
    CopyBlocks,
    Heartbeat,
    PoolInfo,
    ReadBlocks,
    Ready,
    Shutdown,
    StepPlan,
    StepResult,
    WriteBlocks,
)
from workers.kv.pool import KVPool, PoolShape, dtype_of
from workers.kv.transfer import BlockCopier
from workers.link import LocalLink, WorkerLink
from workers.model.attention import AttentionBackend, require_cuda
from workers.model.backends import make_backend
from workers.model.forward import DecoderModel
from workers.plan_check import PlanError
from workers.runner import ModelRunner
from workers.sampler import Sampler
from workers.spec.draft import load_draft
from workers.weights.paths import load_model

if TYPE_CHECKING:
    from workers.model.step_graphs import StepGraphs

logger = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 200
FAULT_TOKEN_ENV = "JUSTAPI_FAULT_TOKEN"
"""Fault injection (tests, drills): a step whose plan holds this token id raises, as a kernel
fault that one request's input trips would (the scheduler then retries the step's other
requests: justapi/scheduler/retries.py). Unset in production."""


def fault_token() -> int | None:
    value = os.environ.get(FAULT_TOKEN_ENV, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{FAULT_TOKEN_ENV}={value!r} is not a token id") from None


def open_pool(spec: ChildSpec, model: DecoderModel, device: str) -> KVPool:
    p = model.params
    if spec.pool:  # CPU: the launcher's shared segment
        info = PoolInfo(pool_id=spec.pool.get("pool_id", 0), kind=spec.pool["kind"], handle=spec.pool["name"], device="cpu",
                        dtype=spec.pool["dtype"], num_layers=spec.pool["num_layers"],
                        num_blocks=spec.pool["num_blocks"], block_size=spec.pool["block_size"],
                        num_kv_heads=spec.pool["num_kv_heads"], head_dim=spec.pool["head_dim"])
        if (info.num_layers, info.num_kv_heads, info.head_dim) != (p.num_layers, p.num_kv_heads, p.head_dim):
            raise ValueError("the shared KV pool's shape does not match the model")
        return KVPool.attach(info)
    require_cuda(device)
    cache = spec.config.cache
    dtype = dtype_of(cache.pool_dtype("cuda"))
    one = PoolShape(p.num_layers, 1, cache.block_size, p.num_kv_heads, p.head_dim)
    num_blocks = cache.pool_blocks
    if num_blocks == 0:
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
        num_blocks = max(4, int(free_bytes * cache.kv_memory_fraction) // one.num_bytes(dtype))
    shape = PoolShape(p.num_layers, num_blocks, cache.block_size, p.num_kv_heads, p.head_dim)
    return KVPool.create(shape, "cuda_ipc", dtype, device, pool_id=spec.index)


class Worker:
    def __init__(self, spec: ChildSpec, stop: StopFlag,
                 link: WorkerLink | None = None) -> None:
        self.spec = spec
        self.stop = stop
        self.link: WorkerLink = link if link is not None else LocalLink()
        self.device = self.link.claim_device(spec)
        gguf = GGUFFile(spec.model_path)
        dtype = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.model = load_model(gguf, self.device, dtype, spec.config.model.weights, progress=False,
                                allow_unused_tensors=spec.config.model.allow_unused_tensors,
                                batch_invariant=spec.config.model.batch_invariant)
        sched, speculative = spec.config.scheduler, spec.config.speculative
        sampled_rows = _max_sampled_rows(sched.max_seqs, sched.max_batched_tokens, speculative)
        self.model.warm_up(sched.max_batched_tokens, sampled_rows)
        self.model_name = gguf.name
        self.pool = open_pool(spec, self.model, self.device)
        block_size = self.pool.shape.block_size
        draft = None
        if speculative.spec == "draft":  # its KV pool: the same block ids, local to this worker
            draft = load_draft(speculative, self.pool.shape.num_blocks, block_size, self.device,
                               weights=spec.config.model.weights)
            draft.model.warm_up(sched.max_batched_tokens, sampled_rows)
        p = self.model.params
        backend = make_backend(self.device, block_size, (p.num_heads, p.num_kv_heads, p.head_dim),
                               batch_invariant=spec.config.model.batch_invariant)
        self.runner = ModelRunner(self.model, self.pool, backend, Sampler(), worker_id=spec.index,
                                  draft=draft)
        self.graphs = self.runner.graphs = self._step_graphs(backend)  # reads the runner's draft
        self.timeline = self.runner.timeline = Timeline.from_env("worker", spec.index)
        self.fault_token = fault_token()
        self.copier = BlockCopier(self.pool, spec.index)  # PD: KV hand-offs into our pool
        self.wire = self.link.wire_copies(self.pool, spec.index)  # copies between hosts (Ray)
        self.context = zmq.Context()
        self.sock = self.link.connect(self.context, spec.endpoints.workers,
                                      worker_identity(spec.index))
        self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True)

    def _step_graphs(self, backend: AttentionBackend) -> StepGraphs | None:
        """GPU: decode (and verification) steps replayed from graphs captured now."""
        if self.device == "cpu":
            return None
        from workers.model.cuda_graphs import build_step_graphs  # Triton: GPU workers only
        config = self.spec.config
        return build_step_graphs(self.model, self.pool, backend, config.scheduler.max_seqs,
                                 self.ready_message().max_context, config.speculative,
                                 config.model.cuda_graphs, config.scheduler.max_batched_tokens)

    def ready_message(self) -> Ready:
        p = self.model.params
        max_context = min(p.max_context, self.spec.config.model.max_context or p.max_context)
        if self.runner.draft is not None:  # the draft computes every position the target does
            max_context = min(max_context, self.runner.draft.model.params.max_context)
        pool = dataclasses.replace(self.pool.info(), host=self.link.host)  # where it lives
        return Ready(worker_id=self.spec.index, pid=os.getpid(), model_name=self.model_name,
                     vocab_size=p.vocab_size, max_context=max_context, pool=pool)

    def run(self) -> None:
        transport.send(self.sock, self.ready_message())
        self._beat.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        with torch.inference_mode():
            while not self.stop.is_set:
                if not poller.poll(POLL_TIMEOUT_MS):
                    continue
                drained = transport.drain(self.sock, on_malformed=self._refuse_unreadable)
                for message in without_stale_orders([m for _, m in drained]):
                    self._on_message(message)

    def _on_message(self, message: Any) -> None:
        if isinstance(message, Shutdown):
            self.stop.set()
        elif isinstance(message, AttachWorker):
            self.attach(message)
        elif isinstance(message, StepPlan):
            self.timeline.mark_cpu(message.step_id)
            self.timeline.mark("plan_in", message.step_id, message.num_seqs)
            transport.send(self.sock, self.execute(message))
            self.timeline.mark("result_out", message.step_id)
        elif isinstance(message, CopyBlocks):
            transport.send(self.sock, self.copier.execute(message))
        elif isinstance(message, (ReadBlocks, WriteBlocks)) and self.wire is not None:
            for reply in self.wire.handle(message):  # a relayed copy, chunk by chunk
                transport.send(self.sock, reply)
        else:
            logger.warning("ignored unexpected %s", type(message).__name__)

    def attach(self, order: AttachWorker) -> None:
        """A restarted scheduler takes this worker over. Every request the dead one planned is
        forgotten (the new one announces what it resubmits as new requests, and a stale
        sampled token must never fill a new plan's placeholder). The dead scheduler's last
        plans ran or were dropped (without_stale_orders) before this order: no KV write of
        theirs can follow a plan of the new scheduler, which plans nothing before every
        worker's Ready."""
        logger.warning("scheduler (pid %d) took over; forgetting %d request(s)",
                       order.scheduler_pid, len(self.runner.requests))
        self.runner.forget(list(self.runner.requests))
        transport.send(self.sock, self.ready_message())

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; its result reports the time it took (the scheduler's step costs).
        A plan that does not fit this worker's pool or model is refused before anything is
        computed (plan_check.py); a step that fails fails its requests, not the worker."""
        try:
            start = time.perf_counter()
            if self.fault_token is not None and bool(np.any(plan.token_ids == self.fault_token)):
                raise RuntimeError(f"injected fault: token {self.fault_token} in step {plan.step_id}")
            result = self.runner.execute(plan)
            return dataclasses.replace(result, step_time_s=time.perf_counter() - start)
        except PlanError as exc:
            logger.warning("refused step %d: %s", plan.step_id, exc)
            return self._failed_step(plan.step_id, f"refused: {exc}")
        except Exception as exc:
            logger.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            return self._failed_step(plan.step_id, f"{type(exc).__name__}: {exc}")

    def _refuse_unreadable(self, exc: ProtocolError) -> None:
        """A StepPlan that does not decode (columns of the wrong lengths, rows outside the
        step) is answered as refused, so its step ends now instead of at the step timeout."""
        if exc.message_type == "StepPlan" and type(exc.step_id) is int:
            logger.warning("refused step %d: %s", exc.step_id, exc)
            transport.send(self.sock, self._failed_step(exc.step_id, f"refused: {exc}"))

    def _failed_step(self, step_id: int, error: str) -> StepResult:
        return StepResult(step_id=step_id, worker_id=self.spec.index, request_ids=[],
                          num_sampled=np.zeros(0, np.int32),
                          sampled_token_ids=np.zeros(0, np.int32), error=error)

    def _heartbeat_loop(self) -> None:
        sock = self.link.connect(self.context, self.spec.endpoints.workers,
                                 heartbeat_identity(self.spec.index))
        try:
            while not self.stop.is_set:
                transport.send(sock, self.heartbeat())
                time.sleep(HEARTBEAT_INTERVAL_S)
        finally:
            sock.close(0)

    def heartbeat(self) -> Heartbeat:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return Heartbeat(worker_id=self.spec.index, time_s=time.time(),
                         rss_bytes=_rss_bytes(), cpu_time_s=usage.ru_utime + usage.ru_stime,
                         gpu=self._gpu_figures(), pool=self._pool_state())

    def _gpu_figures(self) -> dict[str, Any]:
        if self.device == "cpu":
            return {}
        index = torch.device(self.device).index or 0
        figures: dict[str, Any] = {"memory_allocated_bytes": torch.cuda.memory_allocated(index),
                                   "memory_reserved_bytes": torch.cuda.memory_reserved(index)}
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:  # lets the scheduler find this GPU in NVML whatever the ordering
            figures["uuid"] = f"GPU-{uuid}"
        return figures

    def _pool_state(self) -> dict[str, Any]:
        """The KV pool as this worker sees it; on CPU, whether the shared segment still exists."""
        pool = self.pool
        state: dict[str, Any] = {"kind": pool.kind, "handle": pool.handle if pool.kind == "shm" else "",
                                 "num_blocks": pool.shape.num_blocks,
                                 "num_bytes": pool.tensor.numel() * pool.tensor.element_size(),
                                 "is_mapped": pool.tensor.numel() > 0}
        if pool.kind == "shm":
            state["is_linked"] = os.path.exists(os.path.join("/dev/shm", pool.handle))
        return state

    def close(self) -> None:
        self.stop.set()
        self.timeline.dump()
        if self._beat.is_alive():
            self._beat.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        self.sock.close(0)
        self.copier.close()
        self.pool.close()
        if self.runner.draft is not None:
            self.runner.draft.pool.close()
        self.context.term()


def without_stale_orders(messages: list[Any]) -> list[Any]:
    """Messages to handle, in order, less the plans and copy orders that arrived before an
    AttachWorker: a dead scheduler's, never to run (the new one plans nothing before this
    worker's Ready, which answers the AttachWorker)."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, AttachWorker)), default=-1)
    if last < 0:
        return messages
    stale = (StepPlan, CopyBlocks, ReadBlocks, WriteBlocks)
    kept = [m for m in messages[:last] if not isinstance(m, stale)]
    if len(kept) < last:
        logger.warning("dropped %d order(s) of the previous scheduler", last - len(kept))
    return kept + messages[last:]


def _max_sampled_rows(max_seqs: int, max_batched_tokens: int, spec: SpecConfig) -> int:
    """Logit rows of one step: one per sequence, plus every verified draft with speculation."""
    if not spec.is_enabled:
        return max_seqs
    return min(max_batched_tokens, max_seqs * (1 + spec.max_nodes))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def main() -> None:
    spec, stop = start_child()
    try:
        worker = Worker(spec, stop)
    except Exception as exc:  # report any start-up failure as one line, then exit
        logger.debug("start-up failed", exc_info=True)
        report(spec, error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    graphs = worker.graphs.report if worker.graphs is not None else None
    report(spec, info={"device": worker.device, "pool_blocks": worker.pool.shape.num_blocks,
                       "free_memory_bytes": available_memory_bytes(),
                       **({"step_graphs": graphs.line()} if graphs is not None else {})})
    try:
        worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    main()
