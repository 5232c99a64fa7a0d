"""The CPU forward's small per-layer operations as one C call each (csrc/layer_ops.c): RMS norm,
rotary embedding, the gated activation, and the KV store (the attention backend's). At batch 1
their torch forms (4-10 dispatched ops each) cost about as much as the matmuls. `layer_ops()`
is None where the kernel cannot be built or JUSTAPI_CPU_KERNELS=0; each method returns None
(store_kv: False) for what it does not cover (not CPU, not fp32, a layout it does not read),
and the caller keeps its torch form.
`ops_for(device)` gives a GPU forward the Triton forms instead (triton_layer_ops.py).
Owns: the calls. Does not own: where the forward uses them (forward.py, ffn.py, attention.py).
"""
from __future__ import annotations

import ctypes
import functools
import os

from typing import TYPE_CHECKING

import torch

from workers.model.cpu_kernels import load_kernel

if TYPE_CHECKING:
    from workers.model.triton_layer_ops import TritonLayerOps

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


class LayerOps:
    STORE_SYMBOLS = {torch.float32: "store_kv_rows", torch.bfloat16: "store_kv_rows_bf16",
                     torch.float16: "store_kv_rows_f16"}
    """The KV store per pool dtype (the layer chain takes their addresses)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        library.rms_norm_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, i32]
        library.add_rms_norm_rows.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32]
        library.rotary_rows.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
        library.act_mul_rows.argtypes = [ptr, ptr, i64, i64, i32, i32]
        for fn in (library.rms_norm_rows, library.add_rms_norm_rows, library.rotary_rows, library.act_mul_rows):
            fn.restype = None
        self._store = {dtype: getattr(library, name) for dtype, name in self.STORE_SYMBOLS.items()}
        for fn in self._store.values():
            fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr]
            fn.restype = i32
        self.library = library

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """x [rows, n] (rows may be apart, values contiguous) -> x / rms(x) * weight."""
        if x.dim() != 2 or not (_plain(x) and _plain(weight)) or x.stride(1) != 1 or not weight.is_contiguous():
            return None
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=torch.float32)
        self.library.rms_norm_rows(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, n,
                                   eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(s, rms_norm(s)) with s = x + delta, one call: the same bits as torch's add then
        rms_norm. None where delta is None (nothing to fuse) or the layout is not read."""
        if delta is None or x.dim() != 2 or delta.shape != x.shape or not (_plain(x) and _plain(delta)
                                                                             and _plain(weight)):
            return None
        if x.stride(1) != 1 or delta.stride(1) != 1 or not weight.is_contiguous():
            return None
        rows, n = x.shape
        total = torch.empty(rows, n, dtype=torch.float32)
        out = torch.empty(rows, n, dtype=torch.float32)
        self.library.add_rms_norm_rows(x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0),
                                       weight.data_ptr(), total.data_ptr(), out.data_ptr(), rows, n, eps,
                                       torch.get_num_threads())
        return total, out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x [T, heads, dim] (heads contiguous within a token) -> rotated copy; cos/sin [T, 1, half]."""
        if x.dim() != 3 or not (_plain(x) and _plain(cos) and _plain(sin)):
            return None
        tokens, heads, dim = x.shape
        half = cos.shape[-1]
        if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        out = torch.empty(tokens, heads, dim, dtype=torch.float32)
        self.library.rotary_rows(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                 tokens, heads, dim, half, torch.get_num_threads())
        return out

    def act_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """x [rows, 2 f] = [g | u] -> act(g) * u [rows, f]."""
        if x.dim() != 2 or not _plain(x) or not x.is_contiguous() or activation not in ACTIVATIONS:
            return None
        rows, f = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, f, dtype=torch.float32)
        self.library.act_mul_rows(x.data_ptr(), out.data_ptr(), rows, f, ACTIVATIONS[activation],
                                  torch.get_num_threads())
        return out

    def store_kv(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
        """kv [2, num_blocks, block_size, kv_heads, head_dim] (one pool layer) gets k and v [T,
        kv_heads, head_dim] (token rows may be apart) at slots [T] (int64); False (nothing
        written) for a layout it does not read. A bf16 or f16 pool gets each value rounded to
        nearest (ties to even, as .to(kv.dtype)). A slot outside the pool is a ValueError."""
        f32 = torch.float32
        if kv.dtype not in self._store or k.dtype != f32 or v.dtype != f32 or slots.dtype != torch.int64 \
                or k.dim() != 3:
            return False
        _, num_blocks, block_size, kv_heads, head_dim = kv.shape
        rows = k.shape[0]
        if k.shape != v.shape or k.shape[1:] != (kv_heads, head_dim) or len(slots) != rows \
                or k.stride()[1:] != (head_dim, 1) or v.stride()[1:] != (head_dim, 1) \
                or not (kv.is_contiguous() and slots.is_contiguous()) or kv.device.type != "cpu":
            return False
        num_slots = num_blocks * block_size
        if self._store[kv.dtype](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
                                 rows, kv_heads * head_dim, num_slots, kv.data_ptr()):
            raise ValueError(f"a KV slot is outside the pool's {num_slots}")
        return True


def ops_for(device: torch.device) -> LayerOps | TritonLayerOps | None:
    """The small ops' kernels for a forward on `device`: these C ones on a CPU, the Triton ones
    (triton_layer_ops.py) on a GPU, or None."""
    if device.type == "cpu":
        return layer_ops()
    from workers.model.triton_layer_ops import gpu_layer_ops  # imports Triton: GPU workers only
    return gpu_layer_ops()


@functools.cache
def layer_ops() -> LayerOps | None:
    """The kernel, or None (with one warning) where it cannot be built here."""
    return load_kernel("layer_ops", LayerOps, "using torch ops (slower at small batches)")
