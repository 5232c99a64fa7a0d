"""CUDA graph capture for step_graphs.StepGraphs: each step function is warmed up on a side
stream, then captured into a torch.cuda.CUDAGraph sharing one memory pool with the others
(captured largest batch first, so smaller graphs fit in its memory).
`build_step_graphs` makes a GPU runner's StepGraphs at start, uniform and mixed
(mixed_graphs.py) steps alike (with EagerCapture under `--no-cuda-graphs`: the same padded
steps, launched one kernel at a time).
Owns: the torch.cuda calls of capture and replay. Does not own: what is captured.
"""
from __future__ import annotations

import logging

import torch

from justapi.config.spec import SpecConfig
from workers.kv.pool import KVPool
from workers.model.attention import AttentionBackend
from workers.model.forward import DecoderModel
from workers.model.paged_backend import TritonPagedBackend
from workers.model.step_graphs import EagerCapture, GraphCapture, StepFn, StepGraphs, batch_buckets

logger = logging.getLogger(__name__)


class CudaGraphCapture:
    """GraphCapture with torch.cuda.CUDAGraph: one memory pool for every graph."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._grown = 0  # bytes the allocator reserved while capturing (warm-ups included)

    def capture(self, fn: StepFn) -> StepFn:
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compile the kernels, settle the allocator
            fn()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)
        torch.cuda.synchronize(self.device)
        self._grown += max(0, torch.cuda.memory_reserved(self.device) - reserved_before)

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay

    def memory_bytes(self) -> int:
        """What the captures added to the allocator's reserve, summed capture by capture (a
        total taken around all of them read negative where something else freed memory)."""
        return self._grown


def build_step_graphs(model: DecoderModel, pool: KVPool, backend: AttentionBackend, max_seqs: int,
                      max_context: int, spec: SpecConfig | None = None,
                      use_cuda_graphs: bool = True, max_tokens: int = 0) -> StepGraphs | None:
    """The runner's StepGraphs, captured now (None unless `backend` is the Triton one): decode
    steps, with speculation verification steps of the full node budget, and with `max_tokens`
    any step of up to that many rows (mixed_graphs.py); logs what capture took."""
    if not isinstance(backend, TritonPagedBackend):
        return None
    capture: GraphCapture = EagerCapture()
    if use_cuda_graphs and backend.device.type == "cuda":
        capture = CudaGraphCapture(backend.device)
    rows_per_seq = (1, 1 + spec.max_nodes) if spec is not None and spec.is_enabled else (1,)
    graphs = StepGraphs(model, [pool.layer(i) for i in range(pool.shape.num_layers)], backend,
                        capture, batch_buckets(max_seqs), rows_per_seq,
                        max_blocks_per_seq=-(-max_context // pool.shape.block_size))
    if max_tokens > 0:
        from workers.model.mixed_graphs import MAX_ROWS, MixedGraphs
        graphs.mixed = MixedGraphs(model, graphs.kv_layers, backend, capture, min(max_tokens, MAX_ROWS),
                                   graphs.buckets[-1], graphs.inputs.table_width, graphs.logits)
    try:
        with torch.inference_mode():
            report = graphs.capture_all()
    except RuntimeError as exc:  # a forward that cannot be captured: serve eagerly, and say so
        logger.warning("step graphs not captured, every step runs eagerly: %s", exc)
        return None
    if isinstance(capture, CudaGraphCapture):
        logger.info("%s", report.line())
    return graphs
