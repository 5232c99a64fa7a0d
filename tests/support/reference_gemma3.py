"""An independent, dense Gemma 3 forward from a GGUF: the oracle for the served gemma3 model.

Shares nothing with workers/: weights come from `gguf.quants.dequantize` (every K-quant and
Q5/Q8 type expanded to fp32), the forward is Gemma 3 as HF writes it (embedding x sqrt(hidden),
RMSNorm weights that already hold llama.cpp's +1, per-head q/k RMSNorm before rotary, rotate-half
rotary with the local base on sliding-window layers, GELU-tanh MLP, four norms per layer, tied LM
head), one dense causal matmul per layer, fp32 everywhere, no KV cache. Its logits equal HF
transformers' on this GGUF to 1e-4 (checked once; HF's load takes minutes).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import quants

from justapi.model.gguf_reader import BulkArrayReader

SLIDING_WINDOW_PATTERN = 6  # gemma3: layers 5, 11, 17... are global, the rest local
LOCAL_ROPE_BASE = 10000.0  # rope.freq_base_swa's default for gemma3


class ReferenceGemma3:
    def __init__(self, path: str) -> None:
        reader = BulkArrayReader(path, "r")  # gguf's reader, its 262k-token arrays read in bulk
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("gemma3.")}
        self.layers = int(meta["gemma3.block_count"])
        self.heads = int(meta["gemma3.attention.head_count"])
        self.kv_heads = int(meta.get("gemma3.attention.head_count_kv", self.heads))
        self.hidden = int(meta["gemma3.embedding_length"])
        self.head_dim = int(meta.get("gemma3.attention.key_length", self.hidden // self.heads))
        self.eps = float(meta["gemma3.attention.layer_norm_rms_epsilon"])
        self.global_base = float(meta.get("gemma3.rope.freq_base", 1e6))
        self.local_base = float(meta.get("gemma3.rope.freq_base_swa", LOCAL_ROPE_BASE))
        self.window = int(meta.get("gemma3.attention.sliding_window", 0))
        self.w: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            array = quants.dequantize(t.data, t.tensor_type).reshape(shape)
            self.w[t.name] = torch.from_numpy(np.array(array, dtype=np.float32))
        self.w.setdefault("output.weight", self.w["token_embd.weight"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
        # x [T, h, d]: element i pairs with i + d/2 (rotate-half), angle pos * base^(-2i/d)
        half = self.head_dim // 2
        freqs = 1.0 / base ** (torch.arange(half).double() * 2 / self.head_dim)
        angles = positions.double()[:, None] * freqs[None, :]  # [T, d/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        first, second = x.double()[..., :half], x.double()[..., half:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], -1).float()

    def _is_local(self, layer: int) -> bool:
        return self.window > 0 and (layer + 1) % SLIDING_WINDOW_PATTERN != 0

    def _mask(self, n: int, local: bool) -> torch.Tensor:
        """[n, n]: 0 where query q sees key k (k <= q, and q - k < window on local layers)."""
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        visible = (distance >= 0) & ((distance < self.window) if local else True)
        return torch.where(visible, 0.0, float("-inf"))

    def _attention(self, h: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        w, p, n = self.w, f"blk.{layer}.", h.shape[0]
        q = (h @ w[p + "attn_q.weight"].T).view(n, self.heads, self.head_dim)
        k = (h @ w[p + "attn_k.weight"].T).view(n, self.kv_heads, self.head_dim)
        v = (h @ w[p + "attn_v.weight"].T).view(n, self.kv_heads, self.head_dim)
        q, k = self._norm(q, w[p + "attn_q_norm.weight"]), self._norm(k, w[p + "attn_k_norm.weight"])
        local = self._is_local(layer)
        base = self.local_base if local else self.global_base
        q, k = self._rotate(q, positions, base), self._rotate(k, positions, base)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / self.head_dim ** 0.5 + self._mask(n, local)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        return attn @ w[p + "attn_output.weight"].T

    def _mlp(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        w, p = self.w, f"blk.{layer}."
        gate = torch.nn.functional.gelu(h @ w[p + "ffn_gate.weight"].T, approximate="tanh")
        return (gate * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T

    def forward(self, token_ids: list[int], num_last: int | None = None) -> torch.Tensor:
        """Logits [T, vocab] of one sequence starting at position 0 (of its last `num_last`
        positions only, when given)."""
        w = self.w
        positions = torch.arange(len(token_ids))
        x = w["token_embd.weight"][torch.tensor(token_ids)] * self.hidden ** 0.5  # [T, hidden]
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._attention(self._norm(x, w[p + "attn_norm.weight"]), i, positions)
            x = x + self._norm(h, w[p + "post_attention_norm.weight"])
            h = self._mlp(self._norm(x, w[p + "ffn_norm.weight"]), i)
            x = x + self._norm(h, w[p + "post_ffw_norm.weight"])
        x = x if num_last is None else x[-num_last:]
        return self._norm(x, w["output_norm.weight"]) @ w["output.weight"].T

    def greedy(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
        """`num_tokens` greedy continuations (argmax, lowest id on ties) and, for each, its
        logit's lead over the runner-up (how safely another fp32-close forward agrees)."""
        ids, margins = list(token_ids), []
        for _ in range(num_tokens):
            top = torch.topk(self.forward(ids, num_last=1)[0], 2)
            ids.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
        return ids[len(token_ids):], margins
