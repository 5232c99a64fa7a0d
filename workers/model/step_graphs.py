"""Uniform steps (every sequence computes the same number of rows: decodes, or verification
chunks of one size) replayed from graphs captured per (batch-size bucket, rows per sequence)
at start, over static input buffers; other steps (prefill, mixed) replay the graph of their
padded token count where one was built (mixed_graphs.py), else run eagerly.

    static rows:  | S * q real rows | (bucket - S) * q padding rows | unused up to capacity |
    static seqs:  | S real          | padding (no keys, slots -1)   | unused               |

A step is padded to its bucket (paged_layout.pad_layout), copied into the leading slices of
the static buffers, and the bucket's graph replays the whole forward and the output head over
them. Capturing goes through a GraphCapture: CUDA graphs on a GPU (cuda_graphs.py), or plain
calls (EagerCapture: `--no-cuda-graphs`, and the CPU stand-in of the tests), so this module
makes no torch.cuda call and the bookkeeping is tested on CPU.
Owns: buckets, static buffers, the padding and copy-in. Does not own: the capture itself.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from workers.device_upload import upload, upload_into
from workers.model.attention import AttentionBatch
from workers.model.forward import DecoderModel
from workers.model.paged_backend import TENSOR_FIELDS, PagedMetadata, TritonPagedBackend
from workers.model.paged_layout import PagedLayout, block_m_for, pad_layout, paged_layout

StepFn = Callable[[], torch.Tensor]
logger = logging.getLogger(__name__)


class AnyShapeGraphs(Protocol):
    """The mixed steps' graphs (mixed_graphs.py's MixedGraphs), as the uniform ones use them."""

    @property
    def sizes(self) -> Sequence[int]:
        """Their token buckets."""

    def capture_all(self) -> None:
        """Capture every bucket's graph, largest first."""

    def run(self, batch: AttentionBatch, token_ids: np.ndarray,
            rows: np.ndarray) -> torch.Tensor | None:
        """The step's logits from its graph (None: no graph fits it)."""


class GraphCapture(Protocol):
    def capture(self, fn: StepFn) -> StepFn:
        """Capture fn (after warming it up); the result replays it and returns its output."""

    def memory_bytes(self) -> int:
        """Device memory the captured graphs hold."""


class EagerCapture:
    """No graph: each replay calls the function again (same static buffers, same padding)."""

    def capture(self, fn: StepFn) -> StepFn:
        fn()  # warm up, as a real capture does
        return fn

    def memory_bytes(self) -> int:
        return 0


def batch_buckets(max_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph (vLLM's): 1, 2, 4, multiples of 8 up to 256, then of 16,
    up to the first one >= max_seqs."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max(max_seqs, 256) + 16, 16))
    return tuple(s for s in sizes if s < max_seqs) + (next(s for s in sizes if s >= max_seqs),)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding num_seqs sequences (None: more than the largest)."""
    return next((b for b in buckets if b >= num_seqs), None)


def uniform_rows(batch: AttentionBatch) -> int | None:
    """Rows per sequence when every sequence of the step has the same number, else None."""
    rows = batch.num_tokens
    return int(rows[0]) if len(rows) and np.all(rows == rows[0]) else None


@dataclass(frozen=True)
class CaptureReport:
    num_graphs: int
    seconds: float
    memory_bytes: int
    batch_sizes: tuple[int, ...]
    rows_per_seq: tuple[int, ...]
    mixed_rows: tuple[int, ...] = ()  # token buckets of the any-shape graphs (mixed_graphs.py)

    def line(self) -> str:
        mixed = (f", and {len(self.mixed_rows)} for any step of up to {self.mixed_rows[-1]} rows"
                 if self.mixed_rows else "")
        return (f"captured {self.num_graphs} step graphs (batch sizes {self.batch_sizes[0]}.."
                f"{self.batch_sizes[-1]}, rows per sequence {list(self.rows_per_seq)}{mixed}) in "
                f"{self.seconds:.2f} s, {self.memory_bytes / 2**20:.1f} MiB")


PER_ROW = ("token_ids", "positions", "slots")
PER_SEQ = ("first_rows", "starts", "num_rows", "num_keys", "tree_first_rows", "tree_bases",
           "tree_rows", "tree_spans", "tree_offsets")
PER_TILE = ("tile_seqs", "tile_rows")


class StaticInputs:
    """The one int32 buffer every graph reads, cut into fields sized for the largest bucket
    (rows, sequences, tiles, tree bits, then the block tables); a graph of (num_seqs, q) reads
    the leading slice of each field. A step is assembled in a host copy and sent in one
    (pinned, queued) copy; its block tables travel compact, only the columns the step's
    sequences reach, and a device copy spreads them into the graphs' wide tables (the columns
    past a sequence's blocks are never read: the kernel stops at its keys). Copying the whole
    max-context table instead moved 512 KB a step at 256 sequences x 8,192 tokens.

        buffer: | token_ids | positions | slots | per-seq x 9 | tiles x 2 | tree bits |
                | compact tables [S, w] | tables [max_seqs, table_width] (device only) |
    """

    def __init__(self, max_rows: int, max_seqs: int, max_tiles: int, table_width: int,
                 tree_capacity: int, device: torch.device) -> None:
        sizes = [(name, max_rows) for name in PER_ROW] + [(name, max_seqs) for name in PER_SEQ]
        sizes += [(name, max_tiles) for name in PER_TILE] + [("tree_bits", tree_capacity)]
        sizes += [("compact_tables", max_seqs * table_width), ("tables", max_seqs * table_width)]
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes:
            self.offsets[name] = total
            total += size
        self.sizes = dict(sizes)
        self.table_width = table_width
        self.tree_capacity = tree_capacity
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        self.host = np.zeros(self.offsets["tables"], np.int32)
        self.bytes_sent = 0  # host-to-device bytes of the last load (tests read it)

    def field(self, name: str, size: int | None = None) -> torch.Tensor:
        start = self.offsets[name]
        return self.buffer[start:start + (self.sizes[name] if size is None else size)]

    def metadata(self, layout: PagedLayout, has_tree: bool) -> PagedMetadata:
        """Views of the buffer shaped like `layout` (a padded one: its sizes are the graph's)."""
        views: dict[str, Any] = {name: self.field(name, len(getattr(layout, name))) for name in TENSOR_FIELDS
                 if name not in ("tables", "tree_bits")}
        tables = self.field("tables", layout.num_seqs * self.table_width).view(-1, self.table_width)
        return PagedMetadata(**views, tables=tables, tree_bits=self.field("tree_bits"), short=None,
                             longs=[], block_q=layout.block_q, block_m=layout.block_m,
                             num_tiles=layout.num_tiles, has_tree=has_tree)

    def token_ids(self, num_rows: int) -> torch.Tensor:
        return self.field("token_ids", num_rows)

    def fits(self, layout: PagedLayout) -> bool:
        return layout.tables.shape[1] <= self.table_width and len(layout.tree_bits) <= self.tree_capacity

    def load(self, layout: PagedLayout, token_ids: np.ndarray) -> None:
        """Copy a padded step in (rows past the real ones: token 0): one host-to-device copy of
        the fields and the compact tables, one device copy widening the tables."""
        host = self.host
        ids = host[self.offsets["token_ids"]:][:len(layout.slots)]
        ids[:] = 0
        ids[:len(token_ids)] = token_ids
        for name in TENSOR_FIELDS:
            if name != "tables":
                array = getattr(layout, name)
                host[self.offsets[name]:self.offsets[name] + len(array)] = array
        num_seqs, width = layout.tables.shape
        compact = self.offsets["compact_tables"]
        host[compact:compact + num_seqs * width] = layout.tables.reshape(-1)
        end = compact + num_seqs * width
        upload_into(self.buffer[:end], host[:end])
        self.bytes_sent = end * 4
        wide = self.field("tables").view(-1, self.table_width)[:num_seqs, :width]
        wide.copy_(self.buffer[compact:end].view(num_seqs, width))


@dataclass(frozen=True)
class GraphKey:
    num_seqs: int  # the bucket
    rows_per_seq: int  # 1: decode; 1 + drafts: verification


class StepGraphs:
    """The captured uniform steps of one model over one KV pool, and their replay."""

    def __init__(self, model: DecoderModel, kv_layers: list[torch.Tensor], backend: TritonPagedBackend,
                 capture: GraphCapture, buckets: Sequence[int], rows_per_seq: Sequence[int] = (1,),
                 max_blocks_per_seq: int = 1) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.capturer = capture
        self.buckets = tuple(sorted(buckets))
        self.rows_per_seq = tuple(sorted(set(rows_per_seq)))
        max_seqs, max_q = self.buckets[-1], self.rows_per_seq[-1]
        max_tiles = max(max_seqs * -(-q // self._block_q(q)) for q in self.rows_per_seq)
        self.inputs = StaticInputs(max_seqs * max_q, max_seqs, max_tiles, max_blocks_per_seq,
                                   max_seqs * max_q * max_q, backend.device)
        # every graph's logits land here (one buffer, not one per graph: 50 MB at 256 x 49152)
        self.logits = torch.empty(max_seqs * max_q, model.params.vocab_size, device=backend.device)
        self.graphs: dict[GraphKey, StepFn] = {}
        self.report: CaptureReport | None = None
        self.mixed: AnyShapeGraphs | None = None  # the other steps' graphs, where built (cuda_graphs.py)

    def _block_m(self, rows_per_seq: int) -> int:
        return block_m_for(rows_per_seq, self.backend.group)

    def _block_q(self, rows_per_seq: int) -> int:
        return self._block_m(rows_per_seq) // self.backend.group

    def capture_all(self) -> CaptureReport:
        """Capture every (bucket, rows) graph, largest first (smaller ones reuse its memory)."""
        begin = time.perf_counter()
        if self.mixed is not None:  # its largest graph first: the largest step
            try:
                self.mixed.capture_all()
            except RuntimeError as exc:  # the uniform graphs may still be captured: keep them
                logger.warning("mixed step graphs not captured, those steps run eagerly: %s", exc)
                self.mixed = None
        for q in self.rows_per_seq:
            for num_seqs in reversed(self.buckets):
                self._capture(GraphKey(num_seqs, q))
        mixed = tuple(self.mixed.sizes) if self.mixed is not None else ()
        self.report = CaptureReport(len(self.graphs) + len(mixed), time.perf_counter() - begin,
                                    self.capturer.memory_bytes(), self.buckets, self.rows_per_seq, mixed)
        return self.report

    def _capture(self, key: GraphKey) -> None:
        layout = self._dummy_layout(key)
        self.inputs.load(layout, np.zeros(0, np.int64))
        meta = self.inputs.metadata(layout, has_tree=key.rows_per_seq > 1)
        token_ids = self.inputs.token_ids(key.num_seqs * key.rows_per_seq)

        logits = self.logits[:len(token_ids)]  # [num_seqs * q, vocab]

        def step() -> torch.Tensor:
            hidden = self.model.forward(token_ids, self.kv_layers, self.backend, meta)
            return logits.copy_(self.model.logits(hidden))

        self.graphs[key] = self.capturer.capture(step)

    def _dummy_layout(self, key: GraphKey) -> PagedLayout:
        """A step of padding only (nothing read or written): the shapes of the key's graph."""
        empty = AttentionBatch(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                               np.zeros(0, np.int64), self.backend.block_size)
        layout = paged_layout(empty, self.backend.group, self._block_m(key.rows_per_seq))
        return pad_layout(layout, key.num_seqs, key.rows_per_seq)

    def key_for(self, batch: AttentionBatch) -> GraphKey | None:
        q = uniform_rows(batch)
        num_seqs = bucket_for(batch.num_seqs, self.buckets)
        if q is None or q not in self.rows_per_seq or num_seqs is None:
            return None
        return GraphKey(num_seqs, q)

    def run(self, batch: AttentionBatch, token_ids: np.ndarray, rows: np.ndarray) -> torch.Tensor | None:
        """Logits [len(rows), vocab] of the step's flat rows `rows`, from its graph (a uniform
        one, else a mixed one); None when the step has none (too many sequences or rows, too
        long a table, a tree without a uniform graph)."""
        key = self.key_for(batch)
        if key is None or key not in self.graphs:
            return self.mixed.run(batch, token_ids, rows) if self.mixed is not None else None
        layout = pad_layout(paged_layout(batch, self.backend.group, self._block_m(key.rows_per_seq)),
                            key.num_seqs, key.rows_per_seq)
        if not self.inputs.fits(layout) or (layout.has_tree and key.rows_per_seq == 1):
            return self.mixed.run(batch, token_ids, rows) if self.mixed is not None else None
        self.inputs.load(layout, token_ids)
        logits = self.graphs[key]()  # the graph's output buffer: read before the next replay
        if np.array_equal(rows, np.arange(len(rows))):
            return logits[:len(rows)]  # decode: every row, in order (a view, no copy)
        return logits[upload(rows, logits.device)]
