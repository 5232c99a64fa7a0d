"""Rotary position embeddings: a step's cos/sin tables.

The tables hold everything that differs between models' ropes (base, linear scaling, Llama-3
frequency factors, YaRN's blended frequencies, LongRoPE's short/long tables, and the attention
factor both of these multiply cos and sin by), so every kernel that rotates (forward.py's torch
form, csrc/layer_ops.c and the layer chain, the Triton kernel) only multiplies by them.
LongRoPE picks a table per row: long where the row's sequence is longer than the original
context, as transformers picks one per forward from its longest position (`long_rope_rows`).
A sequence that grows past it while decoding is announced again with all its tokens and
recomputed (justapi/scheduler/long_rope.py), as transformers' generate() for Phi-3 recomputes
its cache with the long table there (docs/models.md).
Owns: the frequencies and tables. Does not own: which layers share a table or the rotation
(forward.py), or the kernels (layer_ops.py, triton_layer_ops.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workers.weights.hparams import NO_SCALING, RopeScaling


def base_frequencies(rotary_dims: int, theta: float) -> torch.Tensor:
    """theta ** (2 i / rotary_dims) for each pair i: [rotary_dims / 2] fp32."""
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.int64).float() / rotary_dims
    return theta ** exponents


def yarn_inv_freq(rotary_dims: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies: pair i keeps its original frequency below the correction dim of
    beta_fast rotations in the original context, is interpolated (/ factor) past that of
    beta_slow, and blends linearly between (the blend weight times ext_factor)."""
    base = base_frequencies(rotary_dims, theta)

    def correction_dim(rotations: float) -> float:
        return rotary_dims * math.log(scaling.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rotary_dims - 1)
    ramp = (torch.arange(rotary_dims // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
    extrapolated = (1 - ramp.clamp(0, 1)) * scaling.ext_factor  # [rotary_dims / 2]
    return (1.0 / (scaling.factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated


class Rotary:
    """cos/sin of position * inv_freq (times the attention factor), computed once per step for
    all layers that share it. `rotary_dims` (<= head_dim) leading dims of each head rotate.
    LongRoPE: `long_factors` = (short, long) divisors; a row takes the long one where
    `tables`' long_rows says so (default: where its position + 1 passes the original context)."""

    def __init__(self, rotary_dims: int, theta: float, scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, device: str | torch.device = "cpu",
                 scaling: RopeScaling = NO_SCALING,
                 long_factors: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        base = base_frequencies(rotary_dims, theta)  # [rotary_dims / 2]
        if freq_factors is not None:
            base = base * freq_factors.float().cpu()
        inv_freq = yarn_inv_freq(rotary_dims, theta, scaling) if scaling.kind == "yarn" else 1.0 / base
        self.inv_freq = (inv_freq / scale).to(device)
        self.attn_factor = scaling.attn_factor
        self.original_context = scaling.original_context
        self.long_inv_freq: torch.Tensor | None = None  # [2, rotary_dims / 2]: short, long
        if scaling.kind == "longrope":
            assert long_factors is not None, "the loader reads LongRoPE's tables"
            short, long = (f.float().cpu() for f in long_factors)
            self.long_inv_freq = torch.stack([1.0 / (short * base), 1.0 / (long * base)]).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dims / 2]. long_rows (bool [T], LongRoPE
        only): rows that take the long table whatever their position (a sequence longer than
        the original context: its prefill rows too)."""
        if self.long_inv_freq is None:
            angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dims / 2]
        else:
            is_long = positions + 1 > self.original_context  # [T]
            if long_rows is not None:
                is_long = is_long | long_rows
            inv_freq = self.long_inv_freq[is_long.long()]  # [T, rotary_dims / 2]
            angles = positions.float()[:, None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.attn_factor != 1.0:
            cos, sin = cos * self.attn_factor, sin * self.attn_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def long_rope_rows(scaling: RopeScaling, positions: np.ndarray, num_tokens: np.ndarray,
                   known_lengths: np.ndarray) -> np.ndarray | None:
    """LongRoPE rows (bool [T]) that take the long table though their position + 1 is within
    the original context: the rows of a sequence whose known tokens (its prompt; after a
    preemption, the output too) are more (transformers computes a prompt in one forward, with
    the table its last position picks). None where there are none (then the position alone
    decides, as for every decoding row). positions [T], num_tokens [S], known_lengths [S]."""
    if scaling.kind != "longrope":
        return None
    long_prompt = np.repeat(known_lengths > scaling.original_context, num_tokens)  # [T]
    forced = long_prompt & (positions + 1 <= scaling.original_context)
    return long_prompt if forced.any() else None

