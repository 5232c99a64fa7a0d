"""The llama forward over one flattened step: plain functions with shape comments.

Rows are the step's tokens (many sequences' chunks back to back); attention reaches the other
tokens of each sequence through the paged KV pool via an AttentionBackend. Rotary embeddings
use the "rotate halves" layout: gguf_loader un-permuted GGUF's Q/K rows (see its docstring).
Owns: the math of one step. Does not own: weights loading, KV memory, sampling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from workers.model.attention import AttentionBackend, AttentionMetadata
from workers.weights.gguf_loader import LayerWeights, LlamaWeights
from workers.weights.quant_blocks import Matrix

ONEDNN_BATCH_HINT = 16
"""Rows per step the oneDNN weight layout is tuned for; measured fastest from 1 to 512 rows."""


def onednn_rows(num_rows: int) -> int:
    """Rows padded up to a bucket: oneDNN caches one primitive per input shape and each holds
    buffers that grow with the rows (about 4.5 MB per shape at 256-512 rows for SmolLM2's
    gate/up), so every distinct step size cost memory for good (GBs under varied batches).
    Buckets keep the shapes few (exact to 16, then steps of 8, 32 and 128 rows: at most
    ~12% padding past 64 rows). One row is computed as two: oneDNN's one-row kernel sums in
    another order (SmolLM2's down projection came out 1e-4 off the same row in any bigger
    batch), and a row must come out alike at every batch size, so that a request's matmuls do
    not depend on its batch mates and speculative verification's (many rows) reproduce plain
    decoding's (one row). The second row cost nothing measurable (51-66 us vs 46-64 us)."""
    if num_rows <= 16:
        return max(2, num_rows)
    step = 8 if num_rows <= 64 else 32 if num_rows <= 256 else 128
    return -(-num_rows // step) * step


def has_onednn_linear() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def has_onednn_bf16() -> bool:
    """oneDNN can multiply bf16 here (fast only with AVX512-BF16 or AMX: weight_paths.py)."""
    return has_onednn_linear() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ W.T for one weight W [out, in], on the fastest kernel measured for the device.

    CPU fp32: W is reordered once into oneDNN's blocked layout and multiplied with oneDNN's
    inner product. On the 2-core target this took 25 ms per decode step of SmolLM2's layer
    matmuls at 16 rows versus 44 ms for MKL (W @ x.T) and 57 ms for x @ W[in, out] (see
    docs/runtime.md). CPU with `compute_dtype=torch.bfloat16` (--weights bf16): W is kept in
    bf16 in the same layout and x is rounded to bf16 for the product (oneDNN accumulates in
    fp32 and rounds y to bf16); y comes back in x's dtype, so the residual stream, norms,
    attention and the KV pool stay fp32.
    Elsewhere (CUDA, or a torch without oneDNN): x @ W.T in W's dtype."""

    def __init__(self, weight: Matrix, compute_dtype: torch.dtype | None = None) -> None:
        if not isinstance(weight, torch.Tensor):  # the dense path of a weight kept compressed
            weight = weight.dense().to(weight.device, weight.dtype)
        self.out_features, self.in_features = weight.shape
        on_cpu = weight.device.type == "cpu"
        is_bf16 = compute_dtype == torch.bfloat16 and on_cpu
        if is_bf16:
            if not has_onednn_bf16():
                raise ValueError("bf16 matmuls need oneDNN with bf16 support on this CPU")
            weight = weight.to(torch.bfloat16)
        self.is_onednn = on_cpu and (weight.dtype == torch.float32 or is_bf16) and has_onednn_linear()
        if self.is_onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_onednn:
            return x @ self.weight.T
        num_rows, out_dtype = x.shape[0], x.dtype
        x = x.to(self.weight.dtype)
        padded = onednn_rows(num_rows)
        if padded != num_rows:
            x = torch.cat([x, x.new_zeros(padded - num_rows, x.shape[1])])  # [padded, in]
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        out = out[:num_rows] if padded != num_rows else out
        return out.to(out_dtype)

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None:
        """Build oneDNN's primitive of every row bucket of min_rows..max_rows rows now."""
        if not self.is_onednn:
            return
        for rows in sorted({onednn_rows(m) for m in range(min_rows, max_rows + 1)}):
            self(torch.zeros(rows, self.in_features, dtype=torch.float32))


class LinearLike(Protocol):
    """What the forward needs of a linear layer: Linear, or the 4-bit kernels of quant_linear.py."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None: ...


LinearFactory = Callable[[Matrix], LinearLike]
"""Makes the linear of one loaded weight (dense, or kept quantized: weight_paths.py)."""


@dataclass
class LayerLinears:
    qkv: LinearLike
    attn_out: LinearLike
    gate_up: LinearLike
    down: LinearLike
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor

    @classmethod
    def of(cls, layer: LayerWeights, make_linear: LinearFactory = Linear) -> LayerLinears:
        return cls(make_linear(layer.qkv), make_linear(layer.attn_out), make_linear(layer.gate_up),
                   make_linear(layer.down), layer.attn_norm, layer.ffn_norm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32 whatever the compute dtype (bf16 on GPU), as HF's LlamaRMSNorm does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class Rotary:
    """cos/sin of position * inv_freq, computed once per step for all layers."""

    def __init__(self, head_dim: int, theta: float, scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, device: str | torch.device = "cpu") -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)  # [head_dim / 2]
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float().cpu()
        self.inv_freq = (inv_freq / scale).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim / 2]. Pairs are (i, i + head_dim / 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LlamaModel:
    """The forward. `forward` returns the last hidden states (before the final norm);
    `logits` applies the final norm and the output head to chosen rows only.
    Keeps the embedding (row lookups: dense, or a compressed matrix expanding the rows it is
    asked for) and kernel-ready matrices (`make_linear`, dense oneDNN by default), not the loader's copies."""

    def __init__(self, weights: LlamaWeights, make_linear: LinearFactory = Linear) -> None:
        p = self.params = weights.params
        self.name = weights.name
        self.token_embd = weights.token_embd  # [vocab, hidden]
        self.device, self.dtype = self.token_embd.device, self.token_embd.dtype
        self.layers = [LayerLinears.of(layer, make_linear) for layer in weights.layers]
        self.output_norm = weights.output_norm
        self.output = make_linear(weights.output)
        self.rotary = Rotary(p.head_dim, p.rope_theta, p.rope_scale, weights.rope_freq_factors, self.device)

    def warm_up(self, max_rows: int, max_sampled_rows: int) -> None:
        """Run every row bucket through one layer's matmuls (their shapes are every layer's)
        and the head, so oneDNN builds its per-shape primitives at start-up rather than
        growing the worker's memory during serving."""
        layer = self.layers[0]
        with torch.inference_mode():
            for linear in (layer.qkv, layer.attn_out, layer.gate_up, layer.down):
                linear.warm_up(max_rows)
            self.output.warm_up(max_sampled_rows)

    def forward(self, token_ids: torch.Tensor, kv_layers: list[torch.Tensor],
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """token_ids [T] (int64) -> hidden [T, hidden]. Writes the step's K/V into the pool."""
        p = self.params
        x = self.token_embd[token_ids]  # [T, hidden]
        cos, sin = self.rotary.tables(meta.positions, self.dtype)
        num_rows, num_qk = token_ids.shape[0], p.num_heads + p.num_kv_heads
        for layer, kv in zip(self.layers, kv_layers):
            h = rms_norm(x, layer.attn_norm, p.rms_eps)
            qkv = layer.qkv(h)  # [T, (heads + 2 * kv_heads) * head_dim]
            qk = apply_rotary(qkv[:, :num_qk * p.head_dim].view(num_rows, num_qk, p.head_dim), cos, sin)
            q, k = qk[:, :p.num_heads], qk[:, p.num_heads:]  # [T, heads, hd], [T, kv_heads, hd]
            v = qkv[:, num_qk * p.head_dim:].view(num_rows, p.num_kv_heads, p.head_dim)
            backend.write_kv(kv, k, v, meta)
            attn = backend.attend(kv, q, meta)  # [T, heads, head_dim]
            x = x + layer.attn_out(attn.reshape(num_rows, p.q_size))
            h = rms_norm(x, layer.ffn_norm, p.rms_eps)
            gate_up = layer.gate_up(h)  # [T, 2 * ffn]
            x = x + layer.down(F.silu(gate_up[:, :p.ffn_size]) * gate_up[:, p.ffn_size:])
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (rows to sample) -> fp32 logits [N, vocab]."""
        return self.output(rms_norm(hidden, self.output_norm, self.params.rms_eps)).float()
