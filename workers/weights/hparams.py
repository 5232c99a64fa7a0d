"""A model's hyper-parameters read from GGUF metadata, for every architecture in justapi/model/arch.py.

Shapes (head_dim from `attention.key_length` where present), rope (base, linear scale, rotary
dims, YaRN and LongRoPE scaling: RopeScaling), each layer's attention (sliding window, rope base
and scale of that layer), soft-caps, attention scale and experts; each validated with a message
naming the key. Defaults where a key is absent are llama.cpp's for that architecture
(justapi/model/arch.py); a LongRoPE attention factor the file lacks is derived as transformers does.
Owns: metadata -> HyperParams. Does not own: tensors (gguf_loader.py) or the forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from justapi.model.arch import ArchTraits, arch_traits
from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.info import LONG_ROPE_FACTORS, SHORT_ROPE_FACTORS

MAX_HIDDEN = 65536
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_VOCAB = 4_000_000
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 4096


ROPE_KINDS = ("none", "linear", "yarn", "longrope")
LONG_FACTORS, SHORT_FACTORS = LONG_ROPE_FACTORS, SHORT_ROPE_FACTORS


@dataclass(frozen=True)
class RopeScaling:
    """Context extension beyond linear scaling, as llama.cpp's converter writes it.

    yarn: each frequency blends its interpolated (/ factor) and original value by a ramp over
    the dims between the correction dims of beta_fast and beta_slow rotations in the original
    context (scaled by ext_factor). longrope: per-frequency divisors, the short table for a
    sequence within the original context, the long one past it (the tables are tensors:
    gguf_loader.py). Both multiply cos and sin by attn_factor (q . k by its square)."""

    kind: str = "none"
    """"none" (also for linear scaling, HyperParams.rope_scale), "yarn" or "longrope"."""
    factor: float = 1.0
    """YaRN: the context extension factor (`rope.scaling.factor`)."""
    original_context: int = 0
    """The context the model was trained with (`rope.scaling.original_context_length`)."""
    attn_factor: float = 1.0
    """cos and sin are multiplied by it (YaRN's mscale, LongRoPE's attention factor)."""
    ext_factor: float = 1.0
    """YaRN: weight of the extrapolated frequencies in the ramp (`rope.scaling.yarn_ext_factor`)."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "yarn", "longrope"):
            raise GGUFError(f"unsupported rope scaling {self.kind!r}")
        for name in ("factor", "attn_factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not (isinstance(value, float) and 0.0 < value < 1e6):
                raise GGUFError(f"absurd rope scaling parameter {name}={value!r}")
        if not (isinstance(self.ext_factor, float) and 0.0 <= self.ext_factor <= 1.0):
            raise GGUFError(f"rope scaling yarn_ext_factor {self.ext_factor!r} is not in [0, 1]")
        if self.kind != "none" and not 0 < self.original_context <= MAX_CONTEXT:
            raise GGUFError(f"absurd rope scaling original context {self.original_context!r}")


NO_SCALING = RopeScaling()


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention and rotary use."""

    window: int
    """Sliding window: a query at position q sees keys q - window < k <= q. 0: every key."""
    rope_theta: float
    rope_scale: float
    """Linear rope scaling factor: positions are divided by it."""
    rope_scaled: bool = True
    """Whether the model's YaRN / LongRoPE scaling applies (not on Gemma 3's local layers)."""


@dataclass(frozen=True)
class HyperParams:
    """Shape of a model, read from GGUF metadata."""

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
    """Linear rope scaling factor of the global layers: positions are divided by it."""
    architecture: str = "llama"
    rope_dims: int = 0
    """Leading dims of each head that rotate (partial rotary); 0: all of head_dim."""
    layers: tuple[LayerAttention, ...] = ()
    """Per layer; () = every layer global with (rope_theta, rope_scale)."""
    attn_softcap: float = 0.0
    """Attention scores s become c * tanh(s / c) before the mask and softmax; 0: off."""
    final_softcap: float = 0.0
    """Logits likewise; 0: off."""
    attn_scale: float | None = None
    """Scale of q . k; None: 1 / sqrt(head_dim)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: dense FFN layers."""
    num_experts_used: int = 0
    expert_ffn_size: int = 0
    shared_ffn_size: int = 0
    """The shared expert's FFN width (Qwen2-MoE); 0: none."""
    rope_scaling: RopeScaling = NO_SCALING
    """YaRN or LongRoPE (on the layers whose LayerAttention.rope_scaled)."""

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
        if self.rotary_dims % 2 or self.rotary_dims > self.head_dim:
            raise GGUFError(f"rotary dimension {self.rotary_dims} must be even and at most the "
                            f"head dimension {self.head_dim}")
        for name in ("rope_theta", "rms_eps", "rope_scale"):
            value = getattr(self, name)
            if not (isinstance(value, float) and 0.0 < value < 1e12):
                raise GGUFError(f"absurd model parameter {name}={value!r}")
        if self.rope_scaling.kind != "none" and self.rope_scale != 1.0:
            raise GGUFError(f"linear rope scaling {self.rope_scale} with {self.rope_scaling.kind}: not supported")
        if self.layers and len(self.layers) != self.num_layers:
            raise GGUFError(f"{len(self.layers)} layer attention entries for {self.num_layers} layers")
        self._check_experts()

    def _check_experts(self) -> None:
        if not 0 <= self.num_experts <= MAX_EXPERTS:
            raise GGUFError(f"absurd expert_count {self.num_experts} (expected 0..{MAX_EXPERTS})")
        if self.num_experts and not (0 < self.num_experts_used <= self.num_experts
                                     and 0 < self.expert_ffn_size <= 16 * MAX_HIDDEN):
            raise GGUFError(f"bad experts: {self.num_experts_used} used of {self.num_experts}, "
                            f"expert FFN width {self.expert_ffn_size}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def traits(self) -> ArchTraits:
        return arch_traits(self.architecture)

    def layer(self, i: int) -> LayerAttention:
        if self.layers:
            return self.layers[i]
        return LayerAttention(0, self.rope_theta, self.rope_scale)


def _int(gguf: GGUFFile, suffix: str, default: int | None = None) -> int:
    value = gguf.arch_get(suffix, default)
    if value is None:
        raise GGUFError(f"{gguf.path}: required metadata {gguf.architecture}.{suffix!r} is missing")
    if isinstance(value, (list, tuple)):  # some converters store per-layer arrays
        if len(set(value)) > 1:
            raise GGUFError(f"{gguf.path}: metadata {gguf.architecture}.{suffix} differs between "
                            f"layers ({sorted(set(value))}): not supported")
        value = value[0] if value else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"{gguf.path}: metadata {gguf.architecture}.{suffix} is not an integer: {value!r}")
    return int(value)


def _float(gguf: GGUFFile, suffix: str, default: float) -> float:
    value = gguf.arch_get(suffix, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise GGUFError(f"{gguf.path}: metadata {gguf.architecture}.{suffix} is not a number: {value!r}")
    return float(value)


def read_hyper_params(gguf: GGUFFile) -> HyperParams:
    """Architecture check and hyper-parameters, each validated with a message naming it."""
    traits = arch_traits(gguf.architecture, gguf.path)
    hidden = _int(gguf, "embedding_length")
    heads = _int(gguf, "attention.head_count")
    if heads <= 0 or (not gguf.has(f"{gguf.architecture}.attention.key_length") and hidden % heads):
        raise GGUFError(f"{gguf.path}: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = _int(gguf, "attention.key_length", hidden // heads)
    if _int(gguf, "attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{gguf.path}: unequal key and value head sizes are not supported")
    rope_dims = _int(gguf, "rope.dimension_count", head_dim)
    if traits.permuted_qk and rope_dims != head_dim:  # llama.cpp refuses these too
        raise GGUFError(f"{gguf.path}: partial rotary ({rope_dims} of {head_dim} dims) is not "
                        f"supported for {gguf.architecture}")
    num_layers = _int(gguf, "block_count")
    rope_theta = _float(gguf, "rope.freq_base", 10000.0)
    rope_scale, rope_scaling = _rope_scaling(gguf)
    embd = gguf.tensors.get("token_embd.weight")
    ffn = _int(gguf, "feed_forward_length")
    experts = _int(gguf, "expert_count", 0)
    return HyperParams(
        num_layers=num_layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=_int(gguf, "attention.head_count_kv", heads), head_dim=head_dim,
        ffn_size=ffn, vocab_size=_int(gguf, "vocab_size", int(embd.shape[1]) if embd is not None else None),
        max_context=_int(gguf, "context_length"), rope_theta=rope_theta,
        rms_eps=_float(gguf, "attention.layer_norm_rms_epsilon", 1e-5), rope_scale=rope_scale,
        architecture=gguf.architecture, rope_dims=rope_dims if rope_dims != head_dim else 0,
        layers=_layer_attention(gguf, traits, num_layers, rope_theta, rope_scale),
        attn_softcap=_softcap(gguf, "attn_logit_softcapping", traits.attn_softcap),
        final_softcap=_softcap(gguf, "final_logit_softcapping", traits.final_softcap),
        attn_scale=(hidden // heads) ** -0.5 if num_layers in traits.scale_by_hidden_at_layers else None,
        num_experts=experts, num_experts_used=_int(gguf, "expert_used_count", 0) if experts else 0,
        expert_ffn_size=_expert_ffn(gguf, traits, ffn) if experts else 0,
        shared_ffn_size=(_int(gguf, "expert_shared_feed_forward_length", ffn)
                         if experts and traits.shared_expert else 0),
        rope_scaling=rope_scaling)


def _rope_scaling(gguf: GGUFFile) -> tuple[float, RopeScaling]:
    """(linear scale, YaRN / LongRoPE scaling). A file with LongRoPE tables is LongRoPE whatever
    its type key says, as llama.cpp reads it (the Phi-3 converter writes no type)."""
    kind = str(gguf.arch_get("rope.scaling.type", "none") or "none")
    if kind not in ROPE_KINDS:
        raise GGUFError(f"{gguf.path}: unsupported rope scaling type {kind!r} "
                        f"(supported: {', '.join(ROPE_KINDS)})")
    has_tables = [name in gguf.tensors for name in (LONG_FACTORS, SHORT_FACTORS)]
    if any(has_tables) and not all(has_tables):
        raise GGUFError(f"{gguf.path}: LongRoPE needs both {LONG_FACTORS!r} and {SHORT_FACTORS!r}")
    if kind == "longrope" and not all(has_tables):
        raise GGUFError(f"{gguf.path}: rope scaling type 'longrope' without its factor tables "
                        f"({LONG_FACTORS!r}, {SHORT_FACTORS!r})")
    if all(has_tables) and kind not in ("none", "longrope"):
        raise GGUFError(f"{gguf.path}: LongRoPE factor tables with rope scaling type {kind!r}: not supported")
    if kind == "linear":
        return _float(gguf, "rope.scaling.factor", 1.0), NO_SCALING
    if kind == "yarn":
        return 1.0, _yarn(gguf)
    return 1.0, _longrope(gguf) if all(has_tables) else NO_SCALING


def _yarn(gguf: GGUFFile) -> RopeScaling:
    """llama.cpp's reading: mscale = 0.1 ln(factor) + 1 unless the file gives yarn_attn_factor
    (transformers' attention_factor) or a yarn_log_multiplier (mscale_all_dim); times the
    generic rope.scaling.attn_factor."""
    factor = _float(gguf, "rope.scaling.factor", 0.0)
    if factor < 1.0:
        raise GGUFError(f"{gguf.path}: yarn rope scaling factor {factor} (expected >= 1)")
    log_mul = _float(gguf, "rope.scaling.yarn_log_multiplier", 0.0)
    mscale = _yarn_mscale(factor, 1.0) / _yarn_mscale(factor, log_mul) if log_mul else _yarn_mscale(factor, 1.0)
    return RopeScaling(
        kind="yarn", factor=factor,
        original_context=_int(gguf, "rope.scaling.original_context_length", _int(gguf, "context_length")),
        attn_factor=_float(gguf, "rope.scaling.yarn_attn_factor", mscale) * _float(gguf, "rope.scaling.attn_factor", 1.0),
        ext_factor=_float(gguf, "rope.scaling.yarn_ext_factor", 1.0),
        beta_fast=_float(gguf, "rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=_float(gguf, "rope.scaling.yarn_beta_slow", 1.0))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(gguf: GGUFFile) -> RopeScaling:
    """The converter writes the attention factor it derives from context / original context;
    a file without it gets transformers' derivation (llama.cpp's default, 1, would differ)."""
    context = _int(gguf, "context_length")
    original = _int(gguf, "rope.scaling.original_context_length", context)
    factor = context / original
    derived = math.sqrt(1.0 + math.log(factor) / math.log(original)) if factor > 1.0 and original > 1 else 1.0
    return RopeScaling(kind="longrope", original_context=original,
                       attn_factor=_float(gguf, "rope.scaling.attn_factor", derived))


def _layer_attention(gguf: GGUFFile, traits: ArchTraits, num_layers: int, rope_theta: float,
                     rope_scale: float) -> tuple[LayerAttention, ...]:
    """Each layer's window and rope; sliding layers may have their own rope base (Gemma)."""
    if traits.swa_pattern is None:
        return ()
    window = _int(gguf, "attention.sliding_window", traits.default_window)
    if window < 0:
        raise GGUFError(f"{gguf.path}: negative sliding window {window}")
    pattern = gguf.arch_get("attention.sliding_window_pattern")
    period = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else traits.swa_pattern
    local = LayerAttention(window, _float(gguf, "rope.freq_base_swa", traits.swa_rope_base or rope_theta),
                           1.0 if traits.swa_rope_unscaled else rope_scale, not traits.swa_rope_unscaled)
    full = LayerAttention(0, rope_theta, rope_scale)
    if window == 0:
        return ()
    return tuple(local if period == 0 or i % period < period - 1 else full for i in range(num_layers))


def _softcap(gguf: GGUFFile, suffix: str, default: float | None) -> float:
    if default is None:
        return 0.0
    value = _float(gguf, suffix, default)
    if value < 0:
        raise GGUFError(f"{gguf.path}: negative {gguf.architecture}.{suffix} {value}")
    return value


def _expert_ffn(gguf: GGUFFile, traits: ArchTraits, ffn: int) -> int:
    if traits.expert_ffn_key == "feed_forward_length":
        return ffn
    used = _int(gguf, "expert_used_count", 1)
    return _int(gguf, traits.expert_ffn_key, ffn // max(used, 1))
