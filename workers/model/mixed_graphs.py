"""Steps of any shape - prompt chunks beside decodes, a prefill alone - replayed from graphs
captured per padded token count; uniform steps keep their own graphs (step_graphs.py), whose
buffers and capture this reuses.

A graph of T rows has room for every step of at most T rows and at most max_seqs sequences: the
step is laid out with the prefill tile (paged_layout.block_m_for), then padded to T rows, max_seqs
+ 1 sequences and the most tiles such a step can have (paged_layout.pad_mixed_layout: the extra
rows one padding sequence without keys, the extra tiles idle). The output head runs on the
rows to sample only, gathered through a static index buffer:

    static rows:   | the step's rows | padding rows (one keyless sequence) |  T
    logit rows:    | rows to sample  | 0 ...                               |  max_seqs + 1

Token buckets grow by ~1.5x (32, 48, 64, 96, 128, 192, ...), so a step computes at most
~1.5x its rows. Steps with token trees or more sampled rows than sequences (speculation),
with more rows than the largest bucket or more sequences than max_seqs, run eagerly.
Owns: the token buckets, the padding to them, the sampled-row gather. Does not own: capture.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.device_upload import upload_into
from workers.model.attention import AttentionBatch
from workers.model.forward import DecoderModel
from workers.model.paged_backend import TritonPagedBackend
from workers.model.paged_layout import DECODE_BLOCK_M, block_m_for, pad_mixed_layout, paged_layout
from workers.model.step_graphs import GraphCapture, StaticInputs, StepFn, bucket_for


MAX_ROWS = 2048
"""The largest mixed graph's rows: past it a step's launches are a small part of its time, and
a graph's activations (a ~1B model's gate/up at 2,048 rows: 64 MiB) stay in its pool."""


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Row counts with a mixed graph: 32, 48, 64, 96, 128, ... (x2 every two), up to the first
    one >= max_tokens."""
    sizes: list[int] = []
    size = 32
    while not sizes or sizes[-1] < max_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return tuple(s for s in sizes if s < max_tokens) + (next(s for s in sizes if s >= max_tokens),)


class MixedGraphs:
    """The captured any-shape steps of one model over one KV pool, and their replay."""

    def __init__(self, model: DecoderModel, kv_layers: list[torch.Tensor], backend: TritonPagedBackend,
                 capture: GraphCapture, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 logits: torch.Tensor) -> None:
        """logits: a buffer of >= max_seqs rows the graphs write (the uniform graphs' own)."""
        self.model, self.kv_layers, self.backend, self.capturer = model, kv_layers, backend, capture
        self.buckets = token_buckets(max_tokens)
        self.num_seqs = max_seqs + 1  # one more than a step has: the padding rows' sequence
        self.block_m = block_m_for(DECODE_BLOCK_M + 1, backend.group)  # the prefill tile
        self.block_q = self.block_m // backend.group
        self.inputs = StaticInputs(self.buckets[-1], self.num_seqs, self.num_tiles(self.buckets[-1]),
                                   max_blocks_per_seq, 1, backend.device)
        self.logit_rows = torch.zeros(max_seqs, dtype=torch.int64, device=backend.device)
        self.logits = logits[:max_seqs]
        self.graphs: dict[int, StepFn] = {}

    def num_tiles(self, num_rows: int) -> int:
        """The most tiles a step of <= num_rows rows over <= max_seqs sequences takes, padding's
        included: each sequence's last tile may be partial, and so may the padding's."""
        return self.num_seqs + -(-num_rows // self.block_q)

    def capture_all(self) -> None:
        for num_rows in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self._capture(num_rows)

    def _capture(self, num_rows: int) -> None:
        empty = AttentionBatch(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                               np.zeros(0, np.int64), self.backend.block_size)
        layout = pad_mixed_layout(paged_layout(empty, self.backend.group, self.block_m), self.num_seqs,
                                  num_rows, self.num_tiles(num_rows))
        self.inputs.load(layout, np.zeros(0, np.int64))
        meta = self.inputs.metadata(layout, has_tree=False)
        token_ids = self.inputs.token_ids(num_rows)
        sampled = min(num_rows, len(self.logit_rows))  # a step of T rows samples at most T
        logit_rows, logits = self.logit_rows[:sampled], self.logits[:sampled]

        def step() -> torch.Tensor:
            hidden = self.model.forward(token_ids, self.kv_layers, self.backend, meta)  # [T, hidden]
            return logits.copy_(self.model.logits(hidden[logit_rows]))

        self.graphs[num_rows] = self.capturer.capture(step)

    def run(self, batch: AttentionBatch, token_ids: np.ndarray, rows: np.ndarray) -> torch.Tensor | None:
        """Logits [len(rows), vocab] of the step's flat rows `rows`, from the graph of its token
        bucket; None where the step has none."""
        num_rows = bucket_for(len(token_ids), self.buckets)
        if num_rows is None or batch.tree is not None or batch.num_seqs >= self.num_seqs \
                or len(rows) > len(self.logit_rows) or num_rows not in self.graphs:
            return None
        layout = pad_mixed_layout(paged_layout(batch, self.backend.group, self.block_m), self.num_seqs,
                                  num_rows, self.num_tiles(num_rows))
        if not self.inputs.fits(layout):
            return None
        self.inputs.load(layout, token_ids)
        padded_rows = np.zeros(len(self.logit_rows), np.int64)  # every entry a row of this step
        padded_rows[:len(rows)] = rows
        upload_into(self.logit_rows, padded_rows)
        return self.graphs[num_rows]()[:len(rows)]  # the graph's buffer: read before the next replay

    @property
    def sizes(self) -> Sequence[int]:
        return tuple(sorted(self.graphs))
