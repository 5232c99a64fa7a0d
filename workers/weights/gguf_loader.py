"""Load a GGUF of any architecture in justapi/model/arch.py into torch weights, validated,
with progress on stderr.

Hyper-parameters come from hparams.py; every tensor is checked against them and dequantized
(workers/weights/dequant.py) to the compute dtype. Layout decisions made here:
- matrices stay [out_features, in_features] (GGUF's row order);
- for `llama` files only, Q and K rows (and biases) are un-permuted from llama.cpp's
  interleaved-pairs rotary layout back to "rotate halves"; every other architecture's converter
  leaves them in that layout, so the forward always rotates halves;
- QKV and gate/up are fused into one matrix each (Phi-3 files have them fused already);
  `output.weight` absent -> tied to token_embd; optional tensors (biases, q/k norms, post norms)
  are taken where the file has them;
- MoE layers: each expert's slice of the 3-d expert tensors becomes a matrix of its own;
- with `keep_quantized`, quantized matrices stay compressed: as 4-bit codes
  (quant_blocks.QuantMatrix) or as the file's blocks (block_matrix.BlockMatrix), per type.
Owns: tensor names, shape checks, the Q/K permutation. Does not own: the forward (forward.py).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from justapi.model.gguf_file import GGUFError, GGUFFile
from workers.weights.dequant import dequantize, is_supported, supported_type_names
from workers.weights.hparams import LONG_FACTORS, SHORT_FACTORS, HyperParams, read_hyper_params
from workers.weights.block_matrix import BlockMatrix, RowStack
from workers.weights.quant_blocks import (
    FormChooser,
    Matrix,
    QuantMatrix,
    cat_rows,
    load_matrix,
    planes_where_exact,
)

logger = logging.getLogger(__name__)

@dataclass
class ExpertWeights:
    """A MoE layer's FFN: a router over routed experts, and perhaps a shared expert."""

    router: torch.Tensor  # [num_experts, hidden]
    gate_up: list[Matrix]  # per expert [2 * expert_ffn, hidden]: gate rows then up rows
    down: list[Matrix]  # per expert [hidden, expert_ffn]
    shared_gate_up: Matrix | None = None  # [2 * shared_ffn, hidden]
    shared_down: Matrix | None = None  # [hidden, shared_ffn]
    shared_gate: torch.Tensor | None = None  # [hidden]: the shared expert's weight is sigmoid(x . w)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [q_size + 2 * kv_size, hidden], Q/K rows in rotate-halves layout
    attn_out: Matrix  # [hidden, q_size]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: Matrix | None  # [2 * ffn, hidden]: gate rows then up rows (None in MoE layers)
    down: Matrix | None  # [hidden, ffn]
    qkv_bias: torch.Tensor | None = None  # [q_size + 2 * kv_size]
    attn_out_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    post_attn_norm: torch.Tensor | None = None  # [hidden]
    post_ffn_norm: torch.Tensor | None = None  # [hidden]
    experts: ExpertWeights | None = None


@dataclass
class ModelWeights:
    params: HyperParams
    name: str
    token_embd: Matrix  # [vocab, hidden]
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # [hidden]
    output: Matrix  # [vocab, hidden]; the same object as token_embd when tied
    rope_freq_factors: torch.Tensor | None  # [rotary_dims / 2] or None (llama3-style scaling)
    long_rope_factors: tuple[torch.Tensor, torch.Tensor] | None = None
    """LongRoPE's (short, long) frequency divisors, each [rotary_dims / 2] fp32 (on the CPU)."""

    @property
    def is_tied(self) -> bool:
        return self.output is self.token_embd


def expected_shapes(p: HyperParams) -> dict[str, tuple[int, ...]]:
    """Tensor name (per-layer names with {i}) -> shape in numpy order [out, in]."""
    h, q, kv, ff = p.hidden_size, p.q_size, p.kv_size, p.ffn_size
    e, eff, sff = p.num_experts, p.expert_ffn_size, p.shared_ffn_size
    return {
        "token_embd.weight": (p.vocab_size, h), "output_norm.weight": (h,),
        "output.weight": (p.vocab_size, h), "rope_freqs.weight": (p.rotary_dims // 2,),
        SHORT_FACTORS: (p.rotary_dims // 2,), LONG_FACTORS: (p.rotary_dims // 2,),
        "blk.{i}.attn_norm.weight": (h,),
        "blk.{i}.attn_q.weight": (q, h), "blk.{i}.attn_k.weight": (kv, h),
        "blk.{i}.attn_v.weight": (kv, h), "blk.{i}.attn_qkv.weight": (q + 2 * kv, h),
        "blk.{i}.attn_q.bias": (q,), "blk.{i}.attn_k.bias": (kv,), "blk.{i}.attn_v.bias": (kv,),
        "blk.{i}.attn_qkv.bias": (q + 2 * kv,), "blk.{i}.attn_output.bias": (h,),
        "blk.{i}.attn_output.weight": (h, q),
        "blk.{i}.attn_q_norm.weight": (p.head_dim,), "blk.{i}.attn_k_norm.weight": (p.head_dim,),
        "blk.{i}.post_attention_norm.weight": (h,), "blk.{i}.post_ffw_norm.weight": (h,),
        "blk.{i}.ffn_norm.weight": (h,),
        "blk.{i}.ffn_gate.weight": (ff, h),
        "blk.{i}.ffn_up.weight": (2 * ff if p.traits.fused_gate_up else ff, h),
        "blk.{i}.ffn_down.weight": (h, ff),
        "blk.{i}.ffn_gate_inp.weight": (e, h),
        "blk.{i}.ffn_gate_exps.weight": (e, eff, h), "blk.{i}.ffn_up_exps.weight": (e, eff, h),
        "blk.{i}.ffn_down_exps.weight": (e, h, eff),
        "blk.{i}.ffn_gate_shexp.weight": (sff, h), "blk.{i}.ffn_up_shexp.weight": (sff, h),
        "blk.{i}.ffn_down_shexp.weight": (h, sff), "blk.{i}.ffn_gate_inp_shexp.weight": (h,),
    }


def unpermute_rotary_rows(w: Matrix, num_heads: int) -> Matrix:
    """GGUF Q/K rows -> "rotate halves" rows. llama.cpp's converter stores, per head, the rows
    of pair i (dims i and i + d/2 in HF's layout) next to each other (rows 2i, 2i+1); this
    regroups them as [first halves | second halves]. [num_heads * d, in] or a bias
    [num_heads * d] -> same shape."""
    if isinstance(w, (QuantMatrix, BlockMatrix)):  # the same reordering of its code/block rows
        return w.map_rows(lambda rows: _unpermute(rows, num_heads))  # type: ignore[arg-type,return-value]
    assert isinstance(w, torch.Tensor), "a stack of parts is made after the un-permutation"
    return _unpermute(w, num_heads)


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


class _TensorSource:
    """Reads named tensors from a GGUFFile, checking type and shape, updating a progress bar."""

    def __init__(self, gguf: GGUFFile, params: HyperParams, progress: bool,
                 keep_quantized: bool | FormChooser = False) -> None:
        from tqdm import tqdm

        self.gguf = gguf
        self.form: FormChooser = (keep_quantized if callable(keep_quantized) else
                                  planes_where_exact if keep_quantized else (lambda qtype: "dense"))
        self.shapes = expected_shapes(params)
        self.used: set[str] = set()
        self.bar = tqdm(total=len(gguf.tensors), desc=f"loading {gguf.name}", unit="tensor",
                        file=sys.stderr, disable=not progress, leave=False)

    def has(self, name: str, layer: int | None = None) -> bool:
        return (name if layer is None else name.replace("{i}", str(layer))) in self.gguf.tensors

    def get(self, name: str, layer: int | None = None) -> torch.Tensor:
        key, info = self._checked(name, layer)
        out = dequantize(info.data, info.tensor_type, self.shapes[name], key)
        self.bar.update(1)
        return out

    def optional(self, name: str, layer: int | None = None) -> torch.Tensor | None:
        return self.get(name, layer) if self.has(name, layer) else None

    def matrix(self, name: str, layer: int | None = None) -> Matrix:
        """A weight matrix in the form chosen for its type (dense, 4-bit planes, GGUF blocks)."""
        key, info = self._checked(name, layer)
        out = self._matrix(info.data, info.tensor_type, self.shapes[name], key)
        self.bar.update(1)
        return out

    def experts(self, name: str, layer: int) -> list[Matrix]:
        """A 3-d expert tensor [experts, out, in] as one matrix per expert (an expert's rows
        are whole quant blocks, so each slice is a matrix of its own)."""
        key, info = self._checked(name, layer)
        shape = self.shapes[name][1:]
        out = [self._matrix(info.data[e], info.tensor_type, shape, f"{key}[{e}]")
               for e in range(self.shapes[name][0])]
        self.bar.update(1)
        return out

    def _matrix(self, data: Any, tensor_type: Any, shape: tuple[int, ...], key: str) -> Matrix:
        return load_matrix(data, tensor_type, shape, key, self.form(tensor_type))

    def unused(self) -> list[str]:
        """The file's tensors nothing has read, in file order."""
        return [name for name in self.gguf.tensors if name not in self.used]

    def _checked(self, name: str, layer: int | None) -> tuple[str, Any]:
        key = name if layer is None else name.replace("{i}", str(layer))
        info = self.gguf.tensors.get(key)
        if info is None:
            raise GGUFError(f"{self.gguf.path}: tensor {key!r} is missing")
        self.used.add(key)
        want = self.shapes[name]
        got = tuple(int(d) for d in reversed(info.shape))  # GGUF lists dims innermost first
        if len(want) == 1:
            got = tuple(d for d in got if d != 1) or (1,)  # [n] stored as [1, n] (shared gate)
        if got != want:
            raise GGUFError(f"{self.gguf.path}: tensor {key!r} has shape {list(got)}, "
                            f"metadata implies {list(want)}")
        if not is_supported(info.tensor_type):
            raise GGUFError(f"{self.gguf.path}: tensor {key!r} has unsupported type "
                            f"{info.tensor_type.name} (supported: {', '.join(supported_type_names())})")
        return key, info


def load_weights(gguf: GGUFFile, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 progress: bool = True, keep_quantized: bool | FormChooser = False,
                 allow_unused_tensors: bool = False) -> ModelWeights:
    """Every tensor checked, fused and dequantized to `dtype` on `device` — except, with
    `keep_quantized`, quantized matrices: True keeps the types with 4-bit planes as QuantMatrix,
    a chooser (type -> "dense" | "planes" | "blocks") decides per type (lookups give `dtype`).
    A tensor of the file that the loader does not read (a scaling table, bias or norm of a
    variant it does not know) would be silently ignored and the model misread: GGUFError naming
    them, unless `allow_unused_tensors` (then a warning names them)."""
    params = read_hyper_params(gguf)
    src = _TensorSource(gguf, params, progress, keep_quantized)

    def put(tensor: Any) -> Any:
        if tensor is None or isinstance(tensor, list):
            return [put(t) for t in tensor] if tensor else tensor
        if isinstance(tensor, (QuantMatrix, BlockMatrix, RowStack)):
            return tensor.to(device, dtype)
        return tensor.to(device=device, dtype=dtype).contiguous()

    try:
        layers = [_load_layer(src, params, i, put) for i in range(params.num_layers)]
        token_embd = put(src.matrix("token_embd.weight"))
        output = put(src.matrix("output.weight")) if src.has("output.weight") else token_embd
        weights = ModelWeights(params=params, name=gguf.name, token_embd=token_embd, layers=layers,
                               output_norm=put(src.get("output_norm.weight")), output=output,
                               rope_freq_factors=src.optional("rope_freqs.weight"),
                               long_rope_factors=_long_rope_factors(src, params))
    finally:
        src.bar.close()
    _check_all_used(gguf, src.unused(), allow_unused_tensors)
    return weights


def _long_rope_factors(src: _TensorSource, p: HyperParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    if p.rope_scaling.kind != "longrope":
        return None
    short, long = src.get(SHORT_FACTORS), src.get(LONG_FACTORS)
    if not bool(torch.all(short > 0)) or not bool(torch.all(long > 0)):
        raise GGUFError(f"{src.gguf.path}: LongRoPE factors must be positive")
    return short, long


def _check_all_used(gguf: GGUFFile, unused: list[str], allow: bool) -> None:
    if not unused:
        return
    shown = ", ".join(repr(name) for name in unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
    what = f"{len(unused)} tensor{'s' if len(unused) > 1 else ''} the {gguf.architecture} loader does not use: {shown}"
    if not allow:
        raise GGUFError(f"{gguf.path}: {what} (the model would be misread; "
                        "--allow-unused-tensors loads it anyway)")
    logger.warning("%s: %s (loaded anyway: --allow-unused-tensors)", gguf.path, what)


def _load_layer(src: _TensorSource, p: HyperParams, i: int,
                put: Callable[[Any], Any]) -> LayerWeights:
    qkv, qkv_bias = _attention_rows(src, p, i)
    is_moe = p.num_experts > 0
    gate_up, down = (None, None) if is_moe else _gated_ffn(src, p, i)
    return LayerWeights(
        attn_norm=put(src.get("blk.{i}.attn_norm.weight", i)), qkv=put(qkv),
        attn_out=put(src.matrix("blk.{i}.attn_output.weight", i)),
        ffn_norm=put(src.get("blk.{i}.ffn_norm.weight", i)), gate_up=put(gate_up), down=put(down),
        qkv_bias=put(qkv_bias), attn_out_bias=put(src.optional("blk.{i}.attn_output.bias", i)),
        q_norm=put(src.get("blk.{i}.attn_q_norm.weight", i)) if p.traits.qk_norm else None,
        k_norm=put(src.get("blk.{i}.attn_k_norm.weight", i)) if p.traits.qk_norm else None,
        post_attn_norm=put(src.get("blk.{i}.post_attention_norm.weight", i)) if p.traits.post_norms else None,
        post_ffn_norm=put(src.get("blk.{i}.post_ffw_norm.weight", i)) if p.traits.post_norms else None,
        experts=_experts(src, p, i, put) if is_moe else None)


def _attention_rows(src: _TensorSource, p: HyperParams, i: int) -> tuple[Matrix, torch.Tensor | None]:
    """Fused [Q | K | V] rows (and biases, where the file has them) in rotate-halves layout."""
    if src.has("blk.{i}.attn_qkv.weight", i):  # Phi-3: fused by the converter, HF row order
        return src.matrix("blk.{i}.attn_qkv.weight", i), src.optional("blk.{i}.attn_qkv.bias", i)
    parts = [src.matrix(f"blk.{{i}}.attn_{n}.weight", i) for n in "qkv"]
    biases = [src.optional(f"blk.{{i}}.attn_{n}.bias", i) for n in "qkv"]
    if p.traits.permuted_qk:
        heads = (p.num_heads, p.num_kv_heads)
        parts[:2] = [unpermute_rotary_rows(w, n) for w, n in zip(parts[:2], heads)]
        biases[:2] = [None if b is None else _unpermute(b, n) for b, n in zip(biases[:2], heads)]
    if all(b is None for b in biases):
        return cat_rows(parts), None
    sizes = (p.q_size, p.kv_size, p.kv_size)
    return cat_rows(parts), torch.cat([torch.zeros(n) if b is None else b for b, n in zip(biases, sizes)])


def _gated_ffn(src: _TensorSource, p: HyperParams, i: int) -> tuple[Matrix, Matrix]:
    if p.traits.fused_gate_up:  # Phi-3: ffn_up holds [gate | up]
        gate_up = src.matrix("blk.{i}.ffn_up.weight", i)
    else:
        gate_up = cat_rows([src.matrix("blk.{i}.ffn_gate.weight", i), src.matrix("blk.{i}.ffn_up.weight", i)])
    return gate_up, src.matrix("blk.{i}.ffn_down.weight", i)


def _experts(src: _TensorSource, p: HyperParams, i: int, put: Callable[[Any], Any]) -> ExpertWeights:
    gates, ups = src.experts("blk.{i}.ffn_gate_exps.weight", i), src.experts("blk.{i}.ffn_up_exps.weight", i)
    out = ExpertWeights(router=put(src.get("blk.{i}.ffn_gate_inp.weight", i)),
                        gate_up=put([cat_rows([g, u]) for g, u in zip(gates, ups)]),
                        down=put(src.experts("blk.{i}.ffn_down_exps.weight", i)))
    if p.shared_ffn_size:
        out.shared_gate_up = put(cat_rows([src.matrix("blk.{i}.ffn_gate_shexp.weight", i),
                                           src.matrix("blk.{i}.ffn_up_shexp.weight", i)]))
        out.shared_down = put(src.matrix("blk.{i}.ffn_down_shexp.weight", i))
        out.shared_gate = put(src.get("blk.{i}.ffn_gate_inp_shexp.weight", i))
    return out
