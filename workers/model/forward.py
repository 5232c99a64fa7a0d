"""The decoder forward over one flattened step, for every architecture we serve: plain
functions with shape comments.

Rows are the step's tokens (many sequences' chunks back to back); attention reaches the other
tokens of each sequence through the paged KV pool via an AttentionBackend. Rotary embeddings
use the "rotate halves" layout (gguf_loader un-permuted llama files' Q/K rows); their tables
(rope scaling included) come from rotary.py. What differs
between architectures (norms, biases, q/k norms, activation, rope per layer, sliding windows,
soft-caps, experts) is data read from the file (hparams.py, justapi/model/arch.py), not code.
Owns: the math of one step. Does not own: weights loading, KV memory, sampling, the FFN
blocks (ffn.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from workers.model.attention import DEFAULT_PARAMS, AttentionBackend, AttentionMetadata, AttentionParams
from workers.model.ffn import GatedFfn, MoeFfn
from workers.model.layer_ops import ops_for
from workers.model.linear_like import LinearFactory, LinearLike
from workers.model.rotary import Rotary
from workers.weights.gguf_loader import LayerWeights, ModelWeights
from workers.weights.hparams import NO_SCALING, HyperParams
from workers.weights.quant_blocks import Matrix, QuantMatrix

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


@dataclass
class LayerLinears:
    """One layer, kernel-ready: the loader's tensors, its linears, how it attends and rotates.
    Optional parts are None where the architecture has none (justapi/model/arch.py)."""

    qkv: LinearLike
    attn_out: LinearLike
    ffn: GatedFfn | MoeFfn
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attention: AttentionParams = DEFAULT_PARAMS
    rotary: int = 0  # index into DecoderModel.rotaries
    qkv_bias: torch.Tensor | None = None
    attn_out_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: LayerWeights, p: HyperParams, make_linear: LinearFactory = Linear) -> LayerLinears:
        traits = p.traits
        if layer.experts is not None:
            ffn: GatedFfn | MoeFfn = MoeFfn(layer.experts, make_linear, p.num_experts_used,
                                            traits.experts_renormalized, traits.activation)
        else:
            assert layer.gate_up is not None and layer.down is not None, "a dense layer has its FFN"
            ffn = GatedFfn(make_linear(layer.gate_up), make_linear(layer.down), traits.activation)
        return cls(make_linear(layer.qkv), make_linear(layer.attn_out), ffn, layer.attn_norm,
                   layer.ffn_norm, qkv_bias=layer.qkv_bias, attn_out_bias=layer.attn_out_bias,
                   q_norm=layer.q_norm, k_norm=layer.k_norm, post_attn_norm=layer.post_attn_norm,
                   post_ffn_norm=layer.post_ffn_norm)

    def linears(self, every_expert: bool = True) -> list[LinearLike]:
        """Every matmul of the layer (of a MoE layer, one expert's unless every_expert)."""
        ffn = self.ffn.linears(every_expert) if isinstance(self.ffn, MoeFfn) else self.ffn.linears()
        return [self.qkv, self.attn_out, *ffn]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32 whatever the compute dtype (bf16 on GPU), as HF's LlamaRMSNorm does."""
    ops = ops_for(x.device)
    out = ops.rms_norm(x, weight, eps) if ops is not None else None
    if out is not None:
        return out
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + delta (x when delta is None): the residual stream's add and
    the norm after it, one kernel on a GPU, one C call on a CPU."""
    ops = ops_for(x.device)
    fused = ops.add_rms_norm(x, delta, weight, eps) if ops is not None else None
    if fused is not None:
        return fused
    x = x if delta is None else x + delta
    return x, rms_norm(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, rotary_dims / 2]. Pairs are (i, i + rotary_dims / 2);
    dims from rotary_dims on pass through."""
    ops = ops_for(x.device)
    out = ops.rotary(x, cos, sin) if ops is not None else None
    if out is not None:
        return out
    half = cos.shape[-1]
    if 2 * half != x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :2 * half], cos, sin), x[..., 2 * half:]], dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LayerChainLike(Protocol):
    """A step's layers computed in one call where it covers the step (cpu_layer_chain.py)."""

    def covers(self, backend: AttentionBackend, meta: AttentionMetadata, num_rows: int) -> bool: ...

    def run(self, x: torch.Tensor, kv_layers: list[torch.Tensor], meta: AttentionMetadata,
            tables: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor: ...


class DecoderModel:
    """The forward of every architecture in justapi/model/arch.py: what differs between them
    is read from HyperParams (traits, per-layer attention) and from which tensors a layer has.
    `forward` returns the last hidden states (before the final norm); `logits` applies the
    final norm, the output head (and a final soft-cap) to chosen rows only.
    Keeps the embedding (row lookups: dense, or a compressed matrix expanding the rows it is
    asked for) and kernel-ready matrices (`make_linear`, dense oneDNN by default), not the loader's copies."""

    def __init__(self, weights: ModelWeights, make_linear: LinearFactory = Linear) -> None:
        p = self.params = weights.params
        self.name = weights.name
        self.token_embd = weights.token_embd  # [vocab, hidden]
        self.device, self.dtype = self.token_embd.device, self.token_embd.dtype
        self.embedding_scale = (torch.tensor(p.hidden_size ** 0.5, dtype=self.dtype, device=self.device)
                                if p.traits.embedding_scale else None)
        ropes = sorted({(a.rope_theta, a.rope_scale, a.rope_scaled) for a in map(p.layer, range(p.num_layers))})
        self.rotaries = [Rotary(p.rotary_dims, theta, scale, weights.rope_freq_factors, self.device,
                                p.rope_scaling if scaled else NO_SCALING, weights.long_rope_factors)
                         for theta, scale, scaled in ropes]
        self.layers = []
        for i, layer in enumerate(weights.layers):
            linears = LayerLinears.of(layer, p, make_linear)
            attn = p.layer(i)
            linears.rotary = ropes.index((attn.rope_theta, attn.rope_scale, attn.rope_scaled))
            linears.attention = AttentionParams(p.attn_scale, p.attn_softcap, attn.window)
            self.layers.append(linears)
        self.output_norm = weights.output_norm
        self.output = make_linear(weights.output)
        kept = getattr(self.output, "matrix", None)
        if weights.output is weights.token_embd and kept is not None and getattr(kept, "packed", False):
            self.token_embd = kept  # tied: lookups read the head's packed copy, the file's blocks go
        self.layer_chain: LayerChainLike | None = None
        """A CPU decode step's layers as one C call (cpu_layer_chain.py), set by the loader where
        every layer is one it computes."""

    def warm_up(self, max_rows: int, max_sampled_rows: int) -> None:
        """Run every row bucket through one layer's matmuls (their shapes are every layer's;
        one expert's are every expert's) and the head, so oneDNN builds its per-shape
        primitives at start-up rather than growing the worker's memory during serving."""
        with torch.inference_mode():
            for linear in self.layers[0].linears(every_expert=False):
                linear.warm_up(max_rows)
            self.output.warm_up(max_sampled_rows)

    def forward(self, token_ids: torch.Tensor, kv_layers: list[torch.Tensor],
                backend: AttentionBackend, meta: AttentionMetadata,
                long_rope_rows: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T] (int64) -> hidden [T, hidden]. Writes the step's K/V into the pool.
        long_rope_rows (bool [T], LongRoPE only): rows rotated with the long table whatever
        their position (rotary.long_rope_rows)."""
        p = self.params
        x = self.token_embd[token_ids]  # [T, hidden]
        if self.embedding_scale is not None:
            x = x * self.embedding_scale
        tables = [rotary.tables(meta.positions, self.dtype, long_rope_rows) for rotary in self.rotaries]
        if self.layer_chain is not None and self.layer_chain.covers(backend, meta, x.shape[0]):
            return self.layer_chain.run(x, kv_layers, meta, tables)  # the loop below, from C
        delta = None  # what the last block adds to the residual stream x
        for layer, kv in zip(self.layers, kv_layers):
            x, h = add_rms_norm(x, delta, layer.attn_norm, p.rms_eps)
            delta = self._attention(layer, h, kv, backend, meta, tables[layer.rotary])
            x, h = add_rms_norm(x, delta, layer.ffn_norm, p.rms_eps)
            out = layer.ffn(h)
            delta = out if layer.post_ffn_norm is None else rms_norm(out, layer.post_ffn_norm, p.rms_eps)
        return x if delta is None else x + delta

    def _attention(self, layer: LayerLinears, h: torch.Tensor, kv: torch.Tensor,
                   backend: AttentionBackend, meta: AttentionMetadata,
                   cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One layer's attention block: h [T, hidden] (x after the layer's attention norm) ->
        what it adds to the residual."""
        p = self.params
        num_rows, num_qk = h.shape[0], p.num_heads + p.num_kv_heads
        qkv = layer.qkv(h)  # [T, (heads + 2 * kv_heads) * head_dim]
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, :num_qk * p.head_dim].view(num_rows, num_qk, p.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:  # per head, before rotary
            qk = torch.cat([rms_norm(qk[:, :p.num_heads], layer.q_norm, p.rms_eps),
                            rms_norm(qk[:, p.num_heads:], layer.k_norm, p.rms_eps)], dim=1)
        qk = apply_rotary(qk, *cos_sin)
        q, k = qk[:, :p.num_heads], qk[:, p.num_heads:]  # [T, heads, hd], [T, kv_heads, hd]
        v = qkv[:, num_qk * p.head_dim:].view(num_rows, p.num_kv_heads, p.head_dim)
        backend.write_kv(kv, k, v, meta)
        attn = backend.attend(kv, q, meta, layer.attention)  # [T, heads, head_dim]
        out = layer.attn_out(attn.reshape(num_rows, p.q_size))  # [T, hidden]
        if layer.attn_out_bias is not None:
            out = out + layer.attn_out_bias
        return out if layer.post_attn_norm is None else rms_norm(out, layer.post_attn_norm, p.rms_eps)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> the final norm's output [N, hidden] in fp32: what the head
        reads, and what embeddings pool (llama.cpp's and HF's last_hidden_state)."""
        return rms_norm(hidden, self.output_norm, self.params.rms_eps).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (rows to sample) -> fp32 logits [N, vocab]."""
        p = self.params
        logits = self.output(rms_norm(hidden, self.output_norm, p.rms_eps)).float()
        if p.final_softcap:
            logits = torch.tanh(logits / p.final_softcap) * p.final_softcap
        return logits
