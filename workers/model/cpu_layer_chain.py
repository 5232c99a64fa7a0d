"""A CPU decode step's decoder layers as one C call (csrc/layer_chain.c).

The Python layer loop (forward.py) makes ~10 calls into C per layer, each with its wrapper's
checks, `torch.empty` and a ctypes crossing: at batch 1 about a third of a SmolLM2 step. Where
every part of a step is one the C kernels compute anyway, `LayerChain.run` makes the same calls,
with the same arguments and in the same order, from C, so the hidden states are the same bits
as the loop's (tests/workers/test_layer_chain.py compares them).

It covers a model whose layers are all plain (a gated FFN, biases or none, no q/k or post
norms, no sliding window) with every matmul kept as GGUF blocks (`--weights auto`; a matrix
stacked from parts of different types, as a Q4_K_M file's q/k/v, part by part), and a step of short
chunks only (decode, speculative verification: no prefill chunk) whose plans pick a C kernel for
each matrix; anything else runs the loop. `JUSTAPI_LAYER_CHAIN=0` turns it off.
Owns: that eligibility and the call. Does not own: the kernels (csrc/, block_kernels.py,
layer_ops.py, cpu_kernels.py) or the forward's math (forward.py).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING

import torch

from workers.model.attention import AttentionBackend, AttentionMetadata, TorchCpuBackend
from workers.model.cpu_kernels import load_kernel, paged_attention
from workers.model.ffn import GatedFfn
from workers.model.layer_ops import ACTIVATIONS, layer_ops
from workers.weights.block_kernels import block_kernels
from workers.weights.block_linear import BlockLinear, StackLinear

if TYPE_CHECKING:
    from workers.model.forward import DecoderModel

ENABLE_ENV = "JUSTAPI_LAYER_CHAIN"
KERNEL_PATHS = {"int8": 0, "int8_panels": 1}  # layer_chain.c's matmul slots
_STATUS = {-10: "a block matmul failed", -11: "a KV slot is outside the pool",
           -12: "a row map is outside the step's rows",
           -1: "out of memory for the attention's scratch", -2: "a block table names a block outside the pool",
           -3: "a sequence's keys run past its block table (or its rows past the batch)"}
i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [("matmul", ptr * 2), ("rms_norm", ptr), ("add_rms_norm", ptr), ("rotary", ptr),
                ("store_kv", ptr), ("attention", ptr), ("act_mul", ptr)]


MAX_PARTS = 3
"""Most row blocks of one stacked matrix layer_chain.c takes (q, k and v of different types)."""


class _Layer(ctypes.Structure):
    _fields_ = [("weight", (ptr * MAX_PARTS) * 4), ("type", (i64 * MAX_PARTS) * 4),
                ("out_features", (i64 * MAX_PARTS) * 4), ("path", (i64 * MAX_PARTS) * 4), ("in_features", i64 * 4),
                ("parts", i64 * 4), ("attn_norm", ptr), ("ffn_norm", ptr), ("qkv_bias", ptr), ("out_bias", ptr),
                ("kv", ptr), ("rotary", i64),
                ("scale", ctypes.c_float), ("softcap", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", i64), ("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64),
                ("half", i64), ("ffn", i64), ("activation", i64), ("num_threads", i64), ("eps", ctypes.c_float),
                ("cos", ctypes.POINTER(ptr)), ("sin", ctypes.POINTER(ptr)), ("slots", ptr), ("tables", ptr),
                ("num_keys", ptr), ("num_rows", ptr), ("mask", ptr), ("block_size", i64), ("max_blocks", i64),
                ("num_blocks", i64), ("num_seqs", i64), ("q_max", i64), ("q_rows", ptr), ("valid_rows", ptr),
                ("out_rows", ptr), ("x", ptr), ("delta", ptr), ("h", ptr), ("qkv", ptr), ("qk", ptr), ("q", ptr),
                ("attn", ptr), ("attn_pad", ptr), ("gate_up", ptr), ("act", ptr), ("part", ptr)]


def _parts(linear: object) -> list[BlockLinear]:
    """A matrix's BlockLinears: itself, or a StackLinear's parts (at most MAX_PARTS, all
    BlockLinear); [] where the chain cannot compute it."""
    parts: list = linear.parts if isinstance(linear, StackLinear) else [linear]
    blocks = [p for p in parts if isinstance(p, BlockLinear)]
    return blocks if 0 < len(blocks) == len(parts) <= MAX_PARTS else []


def _address(library: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0


@functools.cache
def _chain_library() -> ctypes.CDLL | None:
    def wrap(library: ctypes.CDLL) -> ctypes.CDLL:
        library.layer_chain.argtypes = [ptr, ptr, i64, ptr]
        library.layer_chain.restype = ctypes.c_int
        return library
    return load_kernel("layer_chain", wrap, "decode layers run one call at a time")


class LayerChain:
    """One model's layers as `_Layer` records, ready for layer_chain.c."""

    def __init__(self, model: DecoderModel, library: ctypes.CDLL, kernels: dict[torch.dtype, _Kernels]) -> None:
        self.model, self._fn, self._kernels = model, library.layer_chain, kernels  # by pool dtype
        p = model.params
        self.linears: list[list[list[BlockLinear]]] = []
        """Per layer, its 4 matrices' parts (one BlockLinear, or a StackLinear's parts)."""
        self._layers = (_Layer * len(model.layers))()
        self.widest_part = 0
        """Columns of the widest part of a stacked matrix (0: none is stacked)."""
        for record, layer in zip(self._layers, model.layers):
            assert isinstance(layer.ffn, GatedFfn)
            linears = [_parts(lin) for lin in (layer.qkv, layer.attn_out, layer.ffn.gate_up, layer.ffn.down)]
            assert all(linears)
            self.linears.append(linears)
            for j, parts in enumerate(linears):
                record.parts[j], record.in_features[j] = len(parts), parts[0].in_features
                for k, lin in enumerate(parts):
                    record.weight[j][k] = lin.matrix.raw.data_ptr()
                    record.type[j][k] = lin.matrix.kernel_type
                    record.out_features[j][k] = lin.out_features
                if len(parts) > 1:
                    self.widest_part = max(self.widest_part, *(lin.out_features for lin in parts))
            record.attn_norm, record.ffn_norm = layer.attn_norm.data_ptr(), layer.ffn_norm.data_ptr()
            record.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            record.out_bias = None if layer.attn_out_bias is None else layer.attn_out_bias.data_ptr()
            record.rotary = layer.rotary
            params = layer.attention
            record.scale = p.head_dim ** -0.5 if params.scale is None else params.scale
            record.softcap = params.softcap
        ffn = model.layers[0].ffn
        assert isinstance(ffn, GatedFfn)
        self.ffn_size, self.activation = ffn.ffn_size, ACTIVATIONS[ffn.activation]
        self._paths: dict[int, list[tuple[tuple[str, ...], ...]] | None] = {}
        """Each row count's path per matrix, or None where one is not a C kernel's (a dense tile)."""
        self._scratch: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, model: DecoderModel) -> LayerChain | None:
        """The chain of `model`, or None where its layers are not all ones it computes."""
        if os.environ.get(ENABLE_ENV, "1") == "0" or model.device.type != "cpu" or model.dtype != torch.float32:
            return None
        for layer in model.layers:
            if not isinstance(layer.ffn, GatedFfn) or layer.ffn.activation not in ACTIVATIONS:
                return None
            if not all(_parts(lin) for lin in (layer.qkv, layer.attn_out, layer.ffn.gate_up, layer.ffn.down)):
                return None
            if any(t is not None for t in (layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_ffn_norm)):
                return None  # (the loop's per-head q/k norms are torch's, whose bits C would not match)
            biases = [(b, lin.out_features) for b, lin in ((layer.qkv_bias, layer.qkv), (layer.attn_out_bias,
                                                                                       layer.attn_out))]
            if not all(b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape == (n,))
                       for b, n in biases):
                return None
            if layer.attention.window or not (layer.attn_norm.is_contiguous() and layer.ffn_norm.is_contiguous()):
                return None
        if len({layer.ffn.ffn_size for layer in model.layers if isinstance(layer.ffn, GatedFfn)}) != 1:
            return None
        blocks, ops, attention, library = block_kernels(), layer_ops(), paged_attention(), _chain_library()
        if blocks is None or ops is None or attention is None or library is None:
            return None
        by_dtype = {}
        for dtype, store in ops.STORE_SYMBOLS.items():  # the pool's dtype picks the store and attention
            kernels = by_dtype[dtype] = _Kernels()
            for name, slot in (("quant_matmul_i8", 0), ("quant_matmul_i8_panels", 1)):
                kernels.matmul[slot] = _address(blocks.library, name)
            for field, name in (("rms_norm", "rms_norm_rows"), ("add_rms_norm", "add_rms_norm_rows"),
                                ("rotary", "rotary_rows"), ("store_kv", store), ("act_mul", "act_mul_rows")):
                setattr(kernels, field, _address(ops.library, name))
            kernels.attention = _address(attention.library, attention.symbol(dtype))
        return cls(model, library, by_dtype)

    def covers(self, backend: AttentionBackend, meta: AttentionMetadata, num_rows: int) -> bool:
        """Whether this step is one the chain computes: short chunks only (decode, speculative
        verification) on the CPU kernel, every matrix on a C path at this row count."""
        short = meta.short
        if short is None or meta.longs or meta.medium is not None or not isinstance(backend, TorchCpuBackend):
            return False
        if backend.kernel is not paged_attention():
            return False
        if num_rows not in self._paths:
            paths = [tuple(tuple(lin.plan.path_for(num_rows) for lin in parts) for parts in linears)
                     for linears in self.linears]
            covered = all(path in KERNEL_PATHS for layer in paths for parts in layer for path in parts)
            self._paths[num_rows] = paths if covered else None
        return self._paths[num_rows] is not None

    def _buffer(self, name: str, rows: int, width: int) -> torch.Tensor:
        flat = self._scratch.get(name)
        if flat is None or flat.numel() < rows * width:
            flat = self._scratch[name] = torch.empty(rows * width, dtype=torch.float32)
        return flat[:rows * width].view(rows, width)

    def run(self, x: torch.Tensor, kv_layers: list[torch.Tensor], meta: AttentionMetadata,
            tables: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [rows, hidden] (the embedded tokens; overwritten) -> the last hidden states: the
        residual stream plus the last layer's FFN output, as at the end of the Python loop."""
        p, rows = self.model.params, x.shape[0]
        short = meta.short
        assert short is not None
        x = x.contiguous()
        hd, heads, kv_heads = p.head_dim, p.num_heads, p.num_kv_heads
        num_qk = heads + kv_heads
        step = _Step()
        step.rows, step.hidden, step.heads, step.kv_heads, step.head_dim = rows, x.shape[1], heads, kv_heads, hd
        cos = [c.contiguous() for c, _ in tables]
        sin = [s.contiguous() for _, s in tables]
        step.half = cos[0].shape[-1]
        step.ffn, step.activation, step.num_threads = self.ffn_size, self.activation, torch.get_num_threads()
        step.eps = p.rms_eps
        cos_ptrs = (ptr * len(cos))(*[c.data_ptr() for c in cos])
        sin_ptrs = (ptr * len(sin))(*[s.data_ptr() for s in sin])
        step.cos, step.sin = cos_ptrs, sin_ptrs
        num_seqs, q_max = short.rows.shape
        step.num_seqs, step.q_max = num_seqs, q_max
        q_rows = short.rows.contiguous()
        step.q_rows = q_rows.data_ptr()
        if short.is_identity:
            step.valid_rows = step.out_rows = None
        else:
            valid_rows, out_rows = short.valid_rows.contiguous(), short.out_rows.contiguous()
            assert valid_rows.numel() == out_rows.numel() == rows, "short chunks cover every row"
            step.valid_rows, step.out_rows = valid_rows.data_ptr(), out_rows.data_ptr()
        mask = short.mask[:, 0].contiguous()
        slots, block_tables = meta.slots.contiguous(), short.tables.contiguous()
        num_keys, num_rows = short.num_keys.contiguous(), short.num_rows.contiguous()
        step.slots, step.tables, step.num_keys, step.num_rows, step.mask = (
            slots.data_ptr(), block_tables.data_ptr(), num_keys.data_ptr(), num_rows.data_ptr(), mask.data_ptr())
        kv0 = kv_layers[0]
        _, num_blocks, block_size, pool_kv_heads, pool_hd = kv0.shape
        assert (pool_kv_heads, pool_hd) == (kv_heads, hd) and kv0.dtype in self._kernels
        step.block_size, step.max_blocks, step.num_blocks = block_size, block_tables.shape[1], num_blocks
        delta = self._buffer("delta", rows, x.shape[1])
        step.x, step.delta = x.data_ptr(), delta.data_ptr()
        padded = num_seqs * q_max
        buffers = {"h": (rows, x.shape[1]), "qkv": (rows, (num_qk + kv_heads) * hd), "qk": (rows, num_qk * hd),
                   "q": (padded, heads * hd), "attn": (rows, heads * hd), "attn_pad": (padded, heads * hd),
                   "gate_up": (rows, 2 * self.ffn_size), "act": (rows, self.ffn_size)}
        if self.widest_part:
            buffers["part"] = (rows, self.widest_part)
        for name, (count, width) in buffers.items():
            setattr(step, name, self._buffer(name, count, width).data_ptr())
        paths = self._paths[rows]
        assert paths is not None, "run only what covers() accepted"
        for record, kv, layer_paths, linears in zip(self._layers, kv_layers, paths, self.linears):
            assert kv.is_contiguous() and kv.shape == kv0.shape and kv.dtype == kv0.dtype
            record.kv = kv.data_ptr()
            for j, (part_paths, parts) in enumerate(zip(layer_paths, linears)):
                for k, (path, lin) in enumerate(zip(part_paths, parts)):
                    record.path[j][k] = KERNEL_PATHS[path]
                    lin.num_calls[path] += 1
        status = self._fn(ctypes.byref(self._kernels[kv0.dtype]), self._layers, len(self._layers),
                          ctypes.byref(step))
        if status == -1:
            raise MemoryError(f"layer chain: {_STATUS[-1]}")
        if status:
            raise ValueError(f"layer chain: {_STATUS.get(status, f'status {status}')}")
        return x.add_(delta)
