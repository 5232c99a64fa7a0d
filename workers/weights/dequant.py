"""GGUF tensor data -> float torch tensors.

Vectorized torch dequantizers for the hot types (F32, F16, BF16, Q8_0, Q4_0, Q4_1: the
default model is Q4_1 + Q8_0) and `gguf.quants.dequantize` for every other type the gguf
package can decode (Q5_0, Q5_1, Q2_K..Q6_K, IQ*, TQ*, ...). Results are bit-identical to
gguf's. Owns: block layouts of the fast types. Does not own: tensor names or shapes (gguf_loader).
"""
from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from justapi.model.gguf_file import GGUFError

Q = GGMLQuantizationType


def _fp16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start+2) of every block read as one float16 -> fp32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 16] packed bytes -> [n_blocks, 32]: low nibbles are weights 0..15,
    high nibbles weights 16..31 (ggml's layout for Q4_0/Q4_1)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block (34 bytes): d f16 | 32 x int8
    d = _fp16_column(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n_blocks, 32]
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block (18 bytes): d f16 | 16 bytes of nibbles, value = d * (q - 8)
    d = _fp16_column(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block (20 bytes): d f16 | m f16 | 16 bytes of nibbles, value = d * q + m
    d = _fp16_column(blocks, 0)
    m = _fp16_column(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()
    return (d * q) + m  # two roundings, as gguf does (no fused multiply-add)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
}
_ELEMENT_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def gguf_can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """True for types the gguf package ships a dequantizer for (a class named after the type)."""
    return qtype in (Q.F32, Q.F16) or isinstance(getattr(gguf_quants, qtype.name, None), type)


def is_supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in _BLOCK_DEQUANT or qtype in _ELEMENT_DTYPES or gguf_can_dequantize(qtype)


def supported_type_names() -> list[str]:
    return sorted(t.name for t in GGMLQuantizationType if is_supported(t))


def _as_tensor(data: np.ndarray) -> torch.Tensor:
    """Zero-copy view of (possibly read-only, memory-mapped) GGUF data. We never write to it:
    every dequantizer below allocates its output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array" notice
        return torch.from_numpy(np.ascontiguousarray(data))


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType,
               shape: tuple[int, ...], name: str = "tensor") -> torch.Tensor:
    """GGUF tensor data (as GGUFReader exposes it) -> fp32 tensor of `shape` (numpy order,
    i.e. [rows, cols] = [out_features, in_features] for a weight matrix)."""
    if not is_supported(qtype):
        raise GGUFError(f"{name}: unsupported tensor type {qtype.name} "
                        f"(supported: {', '.join(supported_type_names())})")
    numel = int(np.prod(shape))
    if qtype in _ELEMENT_DTYPES:
        flat = _as_tensor(data.reshape(-1).view(np.uint8)).view(_ELEMENT_DTYPES[qtype])
        _check_numel(name, flat.numel(), numel)
        return flat.to(torch.float32, copy=True).reshape(shape)  # never alias the file
    if qtype in _BLOCK_DEQUANT:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        raw = _as_tensor(data.reshape(-1).view(np.uint8))
        _check_numel(name, raw.numel() // type_size * block_size, numel)
        return _BLOCK_DEQUANT[qtype](raw.view(-1, type_size)).reshape(shape)
    try:
        out = gguf_quants.dequantize(data, qtype)
    except (ValueError, NotImplementedError) as exc:
        raise GGUFError(f"{name}: cannot dequantize {qtype.name} ({exc})") from None
    _check_numel(name, out.size, numel)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def _check_numel(name: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise GGUFError(f"{name}: data holds {actual} values, shape needs {expected} (corrupt file?)")
