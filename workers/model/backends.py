"""Which attention backend a device gets: the CPU kernels, or on CUDA the in-place Triton
kernels (paged_backend.py; torch's gathered-block SDPA, CudaBackend, where Triton is missing).
Owns: that choice. Does not own: any backend.
"""
from __future__ import annotations

import torch

from workers.model.attention import AttentionBackend, CudaBackend, TorchCpuBackend


def make_backend(device: str, block_size: int, heads: tuple[int, int, int] | None = None,
                 gathered: bool = False, batch_invariant: bool = False) -> AttentionBackend:
    """CPU: TorchCpuBackend (batch_invariant: every chunk on its kernel). CUDA:
    TritonPagedBackend given the model's (num_heads, num_kv_heads, head_dim) and Triton;
    CudaBackend without them or with `gathered`."""
    if torch.device(device).type != "cuda":
        return TorchCpuBackend(block_size, batch_invariant=batch_invariant)
    from workers.model.paged_backend import triton_backend  # imports Triton: GPU only
    backend = None if heads is None or gathered else triton_backend(device, block_size, *heads)
    return backend or CudaBackend(block_size, device)
