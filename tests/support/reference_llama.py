"""An independent, dense llama forward used as the oracle for the paged runtime.

Deliberately shares nothing with workers/: weights come from `gguf.quants.dequantize` in GGUF's
own layout (Q/K rows NOT un-permuted), rotary is applied to GGUF's interleaved pairs
(2i, 2i+1) as complex multiplication, attention is one dense matmul with a causal mask and
K/V heads repeated for GQA. fp64-free but straightforward: fp32 everywhere.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGUFReader, quants


class ReferenceLlama:
    def __init__(self, path: str) -> None:
        reader = GGUFReader(path, "r")
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
        self.layers = meta["llama.block_count"]
        self.heads = meta["llama.attention.head_count"]
        self.kv_heads = meta.get("llama.attention.head_count_kv", self.heads)
        self.hidden = meta["llama.embedding_length"]
        self.head_dim = self.hidden // self.heads
        self.eps = float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5))
        self.theta = float(meta.get("llama.rope.freq_base", 10000.0))
        self.w: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            array = quants.dequantize(t.data, t.tensor_type).reshape(shape)
            self.w[t.name] = torch.from_numpy(np.array(array, dtype=np.float32))
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, h, d]: element pairs (2i, 2i+1) form the complex number rotated by pos * f_i
        freqs = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).double() / self.head_dim)
        angles = positions.double()[:, None] * freqs[None, :]  # [T, d/2]
        rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [T, 1, d/2]
        pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rot).reshape(x.shape).float()

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """All positions' logits [T, vocab] of one sequence starting at position 0."""
        w = self.w
        n = len(token_ids)
        positions = torch.arange(n)
        x = w["token_embd.weight"][torch.tensor(token_ids)]
        causal = torch.full((n, n), float("-inf")).triu(1)
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).view(n, self.heads, self.head_dim)
            k = (h @ w[p + "attn_k.weight"].T).view(n, self.kv_heads, self.head_dim)
            v = (h @ w[p + "attn_v.weight"].T).view(n, self.kv_heads, self.head_dim)
            q, k = self._rotate(q, positions), self._rotate(k, positions)
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / self.head_dim ** 0.5 + causal
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
            x = x + attn @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            gate = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T
        return self._norm(x, w["output_norm.weight"]) @ w["output.weight"].T
