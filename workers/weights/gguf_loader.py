"""Load a llama-family GGUF into dense torch weights, validated, with progress on stderr.

Hyper-parameters come from the `llama.*` metadata; every tensor is checked against them and
dequantized (workers/weights/dequant.py) to the compute dtype. Layout decisions made here:
- matrices stay [out_features, in_features] (GGUF's row order); model.linear computes
  `(W @ x.T).T`, which ran fastest on the CPU we target;
- Q and K rows are un-permuted from GGUF's interleaved-pairs rotary layout back to the
  "rotate halves" layout (what llama.cpp's converter undid), so model.py rotates halves;
- QKV and gate/up are fused into one matrix each; `output.weight` absent -> tied to token_embd;
- with `keep_quantized`, quantized matrices stay compressed: as 4-bit codes
  (quant_blocks.QuantMatrix) or as the file's blocks (block_matrix.BlockMatrix), per type.
Owns: tensor names, shape checks, the Q/K permutation. Does not own: the forward (model.py).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from justapi.model.gguf_file import GGUFError, GGUFFile
from workers.weights.dequant import dequantize, is_supported, supported_type_names
from workers.weights.block_matrix import BlockMatrix, RowStack
from workers.weights.quant_blocks import (
    FormChooser,
    Matrix,
    QuantMatrix,
    cat_rows,
    load_matrix,
    planes_where_exact,
)

SUPPORTED_ARCHITECTURES = ("llama",)
MAX_HIDDEN = 65536
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_VOCAB = 4_000_000
MAX_CONTEXT = 1 << 24


@dataclass(frozen=True)
class LlamaHyperParams:
    """Shape of a llama model, read from GGUF metadata."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    max_context: int
    rope_theta: float
    rms_eps: float
    rope_scale: float = 1.0
    """Linear rope scaling factor: positions are divided by it."""

    def __post_init__(self) -> None:
        limits = {"num_layers": MAX_LAYERS, "hidden_size": MAX_HIDDEN, "num_heads": MAX_HEADS,
                  "num_kv_heads": MAX_HEADS, "head_dim": MAX_HIDDEN, "ffn_size": 16 * MAX_HIDDEN,
                  "vocab_size": MAX_VOCAB, "max_context": MAX_CONTEXT}
        for name, limit in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value <= limit:
                raise GGUFError(f"absurd model dimension {name}={value!r} (expected 1..{limit})")
        if self.num_heads % self.num_kv_heads:
            raise GGUFError(f"head_count {self.num_heads} is not a multiple of "
                            f"head_count_kv {self.num_kv_heads}")
        if self.head_dim % 2:
            raise GGUFError(f"head dimension {self.head_dim} must be even for rotary embeddings")
        for name in ("rope_theta", "rms_eps", "rope_scale"):
            value = getattr(self, name)
            if not (isinstance(value, float) and 0.0 < value < 1e12):
                raise GGUFError(f"absurd model parameter {name}={value!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [q_size + 2 * kv_size, hidden], Q/K rows in rotate-halves layout
    attn_out: Matrix  # [hidden, q_size]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [2 * ffn, hidden]: gate rows then up rows
    down: Matrix  # [hidden, ffn]


@dataclass
class LlamaWeights:
    params: LlamaHyperParams
    name: str
    token_embd: Matrix  # [vocab, hidden]
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # [hidden]
    output: Matrix  # [vocab, hidden]; the same object as token_embd when tied
    rope_freq_factors: torch.Tensor | None  # [head_dim / 2] or None (llama3-style scaling)

    @property
    def is_tied(self) -> bool:
        return self.output is self.token_embd


def _int(gguf: GGUFFile, suffix: str, default: int | None = None) -> int:
    value = gguf.arch_get(suffix, default)
    if value is None:
        raise GGUFError(f"{gguf.path}: required metadata {gguf.architecture}.{suffix!r} is missing")
    if isinstance(value, (list, tuple)):  # some converters store per-layer arrays
        value = value[0] if value else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"{gguf.path}: metadata {gguf.architecture}.{suffix} is not an integer: {value!r}")
    return int(value)


def read_hyper_params(gguf: GGUFFile) -> LlamaHyperParams:
    """Architecture check and hyper-parameters, each validated with a message naming it."""
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: unsupported architecture {arch!r} "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    hidden = _int(gguf, "embedding_length")
    heads = _int(gguf, "attention.head_count")
    if heads <= 0 or hidden % heads:
        raise GGUFError(f"{gguf.path}: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = _int(gguf, "attention.key_length", hidden // heads)
    rope_dims = _int(gguf, "rope.dimension_count", head_dim)
    if rope_dims != head_dim or _int(gguf, "attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{gguf.path}: partial rotary / unequal key-value head sizes are not supported")
    embd = gguf.tensors.get("token_embd.weight")
    vocab = _int(gguf, "vocab_size", int(embd.shape[1]) if embd is not None else None)
    return LlamaHyperParams(
        num_layers=_int(gguf, "block_count"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=_int(gguf, "attention.head_count_kv", heads), head_dim=head_dim,
        ffn_size=_int(gguf, "feed_forward_length"), vocab_size=vocab,
        max_context=_int(gguf, "context_length"),
        rope_theta=float(gguf.arch_get("rope.freq_base", 10000.0)),
        rms_eps=float(gguf.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_scale=_rope_scale(gguf))


def _rope_scale(gguf: GGUFFile) -> float:
    kind = str(gguf.arch_get("rope.scaling.type", "none") or "none")
    if kind == "none":
        return 1.0
    if kind == "linear":
        return float(gguf.arch_get("rope.scaling.factor", 1.0))
    raise GGUFError(f"{gguf.path}: unsupported rope scaling type {kind!r} (supported: none, linear)")


def expected_shapes(p: LlamaHyperParams) -> dict[str, tuple[int, ...]]:
    """Tensor name (per-layer names with {i}) -> shape in numpy order [out, in]."""
    return {
        "token_embd.weight": (p.vocab_size, p.hidden_size),
        "output_norm.weight": (p.hidden_size,),
        "output.weight": (p.vocab_size, p.hidden_size),
        "rope_freqs.weight": (p.head_dim // 2,),
        "blk.{i}.attn_norm.weight": (p.hidden_size,),
        "blk.{i}.attn_q.weight": (p.q_size, p.hidden_size),
        "blk.{i}.attn_k.weight": (p.kv_size, p.hidden_size),
        "blk.{i}.attn_v.weight": (p.kv_size, p.hidden_size),
        "blk.{i}.attn_output.weight": (p.hidden_size, p.q_size),
        "blk.{i}.ffn_norm.weight": (p.hidden_size,),
        "blk.{i}.ffn_gate.weight": (p.ffn_size, p.hidden_size),
        "blk.{i}.ffn_up.weight": (p.ffn_size, p.hidden_size),
        "blk.{i}.ffn_down.weight": (p.hidden_size, p.ffn_size),
    }


def unpermute_rotary_rows(w: Matrix, num_heads: int) -> Matrix:
    """GGUF Q/K rows -> "rotate halves" rows. llama.cpp's converter stores, per head, the rows
    of pair i (dims i and i + d/2 in HF's layout) next to each other (rows 2i, 2i+1); this
    regroups them as [first halves | second halves]. [num_heads * d, in] -> same shape."""
    if isinstance(w, (QuantMatrix, BlockMatrix)):  # the same reordering of its code/block rows
        return w.map_rows(lambda rows: unpermute_rotary_rows(rows, num_heads))  # type: ignore[arg-type,return-value]
    assert isinstance(w, torch.Tensor), "a stack of parts is made after the un-permutation"
    rows, cols = w.shape
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class _TensorSource:
    """Reads named tensors from a GGUFFile, checking type and shape, updating a progress bar."""

    def __init__(self, gguf: GGUFFile, params: LlamaHyperParams, progress: bool,
                 keep_quantized: bool | FormChooser = False) -> None:
        from tqdm import tqdm

        self.gguf = gguf
        self.form: FormChooser = (keep_quantized if callable(keep_quantized) else
                                  planes_where_exact if keep_quantized else (lambda qtype: "dense"))
        self.shapes = expected_shapes(params)
        self.bar = tqdm(total=len(gguf.tensors), desc=f"loading {gguf.name}", unit="tensor",
                        file=sys.stderr, disable=not progress, leave=False)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def get(self, name: str, layer: int | None = None) -> torch.Tensor:
        key, info = self._checked(name, layer)
        out = dequantize(info.data, info.tensor_type, self.shapes[name], key)
        self.bar.update(1)
        return out

    def matrix(self, name: str, layer: int | None = None) -> Matrix:
        """A weight matrix in the form chosen for its type (dense, 4-bit planes, GGUF blocks)."""
        key, info = self._checked(name, layer)
        out = load_matrix(info.data, info.tensor_type, self.shapes[name], key, self.form(info.tensor_type))
        self.bar.update(1)
        return out

    def _checked(self, name: str, layer: int | None) -> tuple[str, Any]:
        key = name if layer is None else name.replace("{i}", str(layer))
        info = self.gguf.tensors.get(key)
        if info is None:
            raise GGUFError(f"{self.gguf.path}: tensor {key!r} is missing")
        want = self.shapes[name]
        got = tuple(int(d) for d in reversed(info.shape))  # GGUF lists dims innermost first
        if got != want:
            raise GGUFError(f"{self.gguf.path}: tensor {key!r} has shape {list(got)}, "
                            f"metadata implies {list(want)}")
        if not is_supported(info.tensor_type):
            raise GGUFError(f"{self.gguf.path}: tensor {key!r} has unsupported type "
                            f"{info.tensor_type.name} (supported: {', '.join(supported_type_names())})")
        return key, info


def load_llama(gguf: GGUFFile, device: str = "cpu", dtype: torch.dtype = torch.float32,
               progress: bool = True, keep_quantized: bool | FormChooser = False) -> LlamaWeights:
    """Every tensor checked, fused and dequantized to `dtype` on `device` — except, with
    `keep_quantized`, quantized matrices: True keeps the types with 4-bit planes as QuantMatrix,
    a chooser (type -> "dense" | "planes" | "blocks") decides per type (lookups give `dtype`)."""
    params = read_hyper_params(gguf)
    src = _TensorSource(gguf, params, progress, keep_quantized)

    def put(tensor: Matrix) -> Any:
        if isinstance(tensor, (QuantMatrix, BlockMatrix, RowStack)):
            return tensor.to(device, dtype)
        return tensor.to(device=device, dtype=dtype).contiguous()

    try:
        layers = [_load_layer(src, params, i, put) for i in range(params.num_layers)]
        token_embd = put(src.matrix("token_embd.weight"))
        output = put(src.matrix("output.weight")) if src.has("output.weight") else token_embd
        rope = src.get("rope_freqs.weight") if src.has("rope_freqs.weight") else None
        return LlamaWeights(params=params, name=gguf.name, token_embd=token_embd, layers=layers,
                            output_norm=put(src.get("output_norm.weight")), output=output,
                            rope_freq_factors=rope)
    finally:
        src.bar.close()


def _load_layer(src: _TensorSource, p: LlamaHyperParams, i: int,
                put: Callable[[Matrix], Any]) -> LayerWeights:
    q = unpermute_rotary_rows(src.matrix("blk.{i}.attn_q.weight", i), p.num_heads)
    k = unpermute_rotary_rows(src.matrix("blk.{i}.attn_k.weight", i), p.num_kv_heads)
    v = src.matrix("blk.{i}.attn_v.weight", i)
    gate, up = src.matrix("blk.{i}.ffn_gate.weight", i), src.matrix("blk.{i}.ffn_up.weight", i)
    return LayerWeights(
        attn_norm=put(src.get("blk.{i}.attn_norm.weight", i)),
        qkv=put(cat_rows([q, k, v])),
        attn_out=put(src.matrix("blk.{i}.attn_output.weight", i)),
        ffn_norm=put(src.get("blk.{i}.ffn_norm.weight", i)),
        gate_up=put(cat_rows([gate, up])),
        down=put(src.matrix("blk.{i}.ffn_down.weight", i)))
