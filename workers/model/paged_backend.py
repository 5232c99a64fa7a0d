"""The GPU attention backend: K/V stored and read in place in the block pool by the Triton
kernels of triton_attention.py, one launch of each per layer for any step (decodes, prefill
chunks, verification trees), with metadata built once per step (paged_layout.py).

The metadata is a set of device tensors; a CUDA-graph step (step_graphs.py) fills the same
fields from its static buffers, so the layers run the same code either way.
Owns: PagedMetadata and the backend. Does not own: the kernels or the layout arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.device_upload import upload
from workers.model.attention import AttentionBackend, AttentionBatch, AttentionMetadata
from workers.model.paged_layout import PagedLayout, paged_layout
from workers.model.triton_attention import (
    AttentionParams,
    LayerAttention,
    has_triton,
    is_interpreted,
    paged_attention,
    store_kv,
)

TENSOR_FIELDS = ("positions", "slots", "first_rows", "starts", "num_rows", "num_keys", "tables",
                 "tile_seqs", "tile_rows", "tree_first_rows", "tree_bases", "tree_rows",
                 "tree_spans", "tree_offsets", "tree_bits")
"""PagedLayout's arrays, each a device tensor of the same name in PagedMetadata."""


@dataclass(kw_only=True)
class PagedMetadata(AttentionMetadata):
    """AttentionMetadata (positions, slots; no gathered groups) plus the kernel's tensors."""

    first_rows: torch.Tensor
    starts: torch.Tensor
    num_rows: torch.Tensor
    num_keys: torch.Tensor
    tables: torch.Tensor
    tile_seqs: torch.Tensor
    tile_rows: torch.Tensor
    tree_first_rows: torch.Tensor
    tree_bases: torch.Tensor
    tree_rows: torch.Tensor
    tree_spans: torch.Tensor
    tree_offsets: torch.Tensor
    tree_bits: torch.Tensor
    block_q: int
    block_m: int
    num_tiles: int
    has_tree: bool

    @classmethod
    def upload(cls, layout: PagedLayout, device: torch.device) -> PagedMetadata:
        """Every array as int32 in one host-to-device copy (queued: device_upload.py), then
        views of it."""
        arrays = [np.asarray(getattr(layout, name)).reshape(-1) for name in TENSOR_FIELDS]
        flat = upload(np.concatenate(arrays).astype(np.int32), device)
        tensors: dict[str, Any] = dict(zip(TENSOR_FIELDS, torch.split(flat, [len(a) for a in arrays])))
        tensors["tables"] = tensors["tables"].view(layout.tables.shape)
        return cls(**tensors, short=None, longs=[], block_q=layout.block_q,
                   block_m=layout.block_m, num_tiles=layout.num_tiles, has_tree=layout.has_tree)


class TritonPagedBackend(AttentionBackend):
    """Attention read from the pool in place (Triton). On a CPU device the kernels run in
    Triton's interpreter: slow, for tests only."""

    def __init__(self, block_size: int, device: torch.device | str, group: int,
                 params: LayerAttention = AttentionParams()) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cpu" and not is_interpreted():
            raise ValueError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                             "triton is first imported")
        self.group = group  # query heads per KV head
        self.params = params

    def prepare(self, batch: AttentionBatch) -> PagedMetadata:
        if batch.block_size != self.block_size:
            raise ValueError(f"batch built for block size {batch.block_size}, backend {self.block_size}")
        return PagedMetadata.upload(paged_layout(batch, self.group), self.device)

    def write_kv(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        store_kv(kv, k, v, meta.slots)

    def attend(self, kv: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata,
               params: LayerAttention | None = None) -> torch.Tensor:
        """`params`: this layer's scale, window and soft-cap where a model passes them (else
        the backend's); the same metadata serves every layer, windowed or not."""
        assert isinstance(meta, PagedMetadata), "metadata from another backend"
        return paged_attention(q, kv, meta, self.params if params is None else params)


def triton_backend(device: str, block_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> TritonPagedBackend | None:
    """The backend for a llama attention of these heads, or None without Triton."""
    if not has_triton():
        return None
    return TritonPagedBackend(block_size, device, num_heads // num_kv_heads,
                              AttentionParams(scale=head_dim ** -0.5))
