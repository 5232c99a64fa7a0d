"""The GPU forward's small per-layer operations as one Triton kernel each: the residual add
fused with the RMS norm that follows it, the rotary embedding, and the gated activation.
In torch form a bf16 layer launched ~37 kernels (each norm ~9: casts, pow, mean, rsqrt, muls;
rotary ~8; the activation 3), and a captured decode step of SmolLM2 replays ~1,100 of them:
at batch 1 the step was their launch gaps, not its 270 MB of weights. With these a layer is
10 launches (norm, qkv, rotary, store, attend, out, norm, gate_up, act, down).
Each op computes in fp32 and rounds once to the output's dtype (the torch forms rounded each
intermediate to bf16), so the step's logits move by bf16 rounding only.
The CPU forward keeps its own (layer_ops.py); `gpu_layer_ops()` is None without Triton or with
JUSTAPI_GPU_KERNELS=0, and a method returns None for a layout it does not read (the caller
keeps its torch form). Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests).
Owns: the kernels and their launch. Does not own: where the forward uses them (forward.py, ffn.py).
"""
from __future__ import annotations

import functools
import os
from typing import no_type_check

import torch

from workers.model.triton_attention import _jit, _next_pow2, has_triton

try:
    import triton.language as tl
except ImportError:  # never launched without Triton
    tl = None  # type: ignore[assignment]

ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1}
ACT_BLOCK = 1024
"""Output columns per program of the activation (a row of SmolLM2's FFN is 1536)."""


@_jit
@no_type_check
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_d, stride_s, stride_o,
                         n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual stream's add, rounded to its dtype as torch's add rounds it
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


@_jit
@no_type_check
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                   heads, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (j < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    tl.store(dst + j, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + j, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if BLOCK_REST > 0:  # partial rotary: dims past 2 * HALF pass through
        r = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
        rest_mask = (h < heads) & (r < HEAD_DIM)
        tl.store(dst + r, tl.load(src + r, mask=rest_mask, other=0.0), mask=rest_mask)


@_jit
@no_type_check
def _act_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, f, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + f + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        a = g / (1.0 + tl.exp(-g))
    else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2 z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * z)))
    tl.store(out_ptr + row * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous (rows may be apart)."""
    return t.dim() == 2 and t.stride(1) == 1


class TritonLayerOps:
    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(s, s / rms(s) * weight) with s = x + delta (x itself when delta is None), in one
        kernel; x, delta [rows, n]."""
        if not _rows(x) or (delta is not None and (not _rows(delta) or delta.shape != x.shape
                                                   or delta.dtype != x.dtype)) or not weight.is_contiguous():
            return None
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        total = x if delta is None else torch.empty_like(out)
        d = x if delta is None else delta
        if rows:
            _add_rms_norm_kernel[(rows,)](x, d, weight, total, out, x.stride(0), d.stride(0),
                                          total.stride(0),
                                          out.stride(0), n, eps, HAS_DELTA=delta is not None,
                                          BLOCK=_next_pow2(n))
        return total, out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        normed = self.add_rms_norm(x, None, weight, eps)
        return None if normed is None else normed[1]

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x [T, heads, dim] (dims contiguous) -> rotated copy; cos/sin [T, 1, half], contiguous."""
        if x.dim() != 3 or x.stride(2) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        tokens, heads, dim = x.shape
        half = cos.shape[-1]
        out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
        if tokens:
            _rotary_kernel[(tokens,)](x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                      heads, HALF=half, HEAD_DIM=dim, BLOCK_H=_next_pow2(heads),
                                      BLOCK_HALF=_next_pow2(half),
                                      BLOCK_REST=_next_pow2(dim - 2 * half) if dim > 2 * half else 0)
        return out

    def act_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """x [rows, 2 f] = [g | u] -> act(g) * u [rows, f]."""
        if not _rows(x) or activation not in ACTIVATION_IDS:
            return None
        rows, f = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, f, dtype=x.dtype, device=x.device)
        if rows:
            _act_mul_kernel[(rows, -(-f // ACT_BLOCK))](x, out, x.stride(0), out.stride(0), f,
                                                        ACT=ACTIVATION_IDS[activation], BLOCK=ACT_BLOCK)
        return out


@functools.cache
def gpu_layer_ops() -> TritonLayerOps | None:
    """The kernels for a GPU forward, or None (no Triton, or JUSTAPI_GPU_KERNELS=0)."""
    if not has_triton() or os.environ.get("JUSTAPI_GPU_KERNELS", "1") == "0":
        return None
    return TritonLayerOps()
