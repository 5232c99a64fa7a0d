"""The llama forward over one flattened step: plain functions with shape comments.

Rows are the step's tokens (many sequences' chunks back to back); attention reaches the other
tokens of each sequence through the paged KV pool via an AttentionBackend. Rotary embeddings
use the "rotate halves" layout: gguf_loader un-permuted GGUF's Q/K rows (see its docstring).
Owns: the math of one step. Does not own: weights loading, KV memory, sampling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention import AttentionBackend, AttentionMetadata
from workers.gguf_loader import LlamaWeights


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ w[out, in].T -> [M, out], contiguous.

    On CPU computed as (w @ x.T).T: with MKL on the target machine that ran 1.5-2x faster than
    x @ w.T for M >= 2, and M = 1 is padded to 2 (a lone row dispatches to a gemv that
    reads the weights at half the speed)."""
    if x.device.type != "cpu":
        return x @ w.T
    if x.shape[0] == 1:
        return (w @ torch.cat([x, x]).T)[:, :1].T.contiguous()
    return (w @ x.T).T.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


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
    """Weights + the forward. `forward` returns the last hidden states (before the final
    norm); `logits` applies the final norm and the output head to chosen rows only."""

    def __init__(self, weights: LlamaWeights) -> None:
        self.weights = weights
        self.params = weights.params
        self.device = weights.token_embd.device
        self.dtype = weights.token_embd.dtype
        p = self.params
        self.rotary = Rotary(p.head_dim, p.rope_theta, p.rope_scale, weights.rope_freq_factors, self.device)

    def forward(self, token_ids: torch.Tensor, kv_layers: list[torch.Tensor],
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """token_ids [T] (int64) -> hidden [T, hidden]. Writes the step's K/V into the pool."""
        w, p = self.weights, self.params
        x = w.token_embd[token_ids]  # [T, hidden]
        cos, sin = self.rotary.tables(meta.positions, self.dtype)
        num_rows, num_qk = token_ids.shape[0], p.num_heads + p.num_kv_heads
        for layer, kv in zip(w.layers, kv_layers):
            h = rms_norm(x, layer.attn_norm, p.rms_eps)
            qkv = linear(h, layer.qkv)  # [T, (heads + 2 * kv_heads) * head_dim]
            qk = apply_rotary(qkv[:, :num_qk * p.head_dim].view(num_rows, num_qk, p.head_dim), cos, sin)
            q, k = qk[:, :p.num_heads], qk[:, p.num_heads:]  # [T, heads, hd], [T, kv_heads, hd]
            v = qkv[:, num_qk * p.head_dim:].view(num_rows, p.num_kv_heads, p.head_dim)
            backend.write_kv(kv, k, v, meta)
            attn = backend.attend(kv, q, meta)  # [T, heads, head_dim]
            x = x + linear(attn.reshape(num_rows, p.q_size), layer.attn_out)
            h = rms_norm(x, layer.ffn_norm, p.rms_eps)
            gate_up = linear(h, layer.gate_up)  # [T, 2 * ffn]
            x = x + linear(F.silu(gate_up[:, :p.ffn_size]) * gate_up[:, p.ffn_size:], layer.down)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (rows to sample) -> fp32 logits [N, vocab]."""
        h = rms_norm(hidden, self.weights.output_norm, self.params.rms_eps)
        return linear(h, self.weights.output).float()
