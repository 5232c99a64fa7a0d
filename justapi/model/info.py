"""The facts about a model that the control plane needs, read from GGUF metadata (torch-free).

Shapes for sizing the KV pool, the context length for validation, the name to serve, the
original context of a LongRoPE model (the scheduler switches its rope table there), and the
sampling defaults the model's authors wrote into it (llama.cpp's `general.sampling.*` keys).
Owns: ModelInfo, those defaults and model-path resolution (default model, file, `synthetic:`).
Does not own: weights (workers/) or the tokenizer (justapi/frontend/text/tokenizer.py).
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from justapi.model.arch import arch_traits
from justapi.model.gguf_file import GGUFError, GGUFFile, resolve_model_path
from justapi.sampling import SamplingParams

SYNTHETIC_PREFIX = "synthetic:"
GGUF_SAMPLING_KEYS = {
    "temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat"}
"""SamplingParams field -> the GGUF metadata key where a model may carry its default (the
gguf package's Keys.General.SAMPLING_*, spelled out so `import justapi.config` stays light)."""
LONG_ROPE_FACTORS, SHORT_ROPE_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
"""LongRoPE's factor tables: a file with both is LongRoPE whatever its rope.scaling.type says
(llama.cpp's Phi-3 converter writes no type; workers/weights/hparams.py reads them)."""


@dataclass(frozen=True)
class ModelInfo:
    path: str
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    long_rope_context: int = 0
    """LongRoPE (Phi-3.5, Phi-3-128k): its original context, past which a sequence is computed
    with the long table (justapi/scheduler/long_rope.py); 0 for every other model."""

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Every layer keeps K and V of every position (sliding-window layers too: docs/models.md)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelInfo:
        arch = gguf.architecture
        arch_traits(arch, gguf.path)  # refuses an architecture we do not serve
        hidden = _positive(gguf, "embedding_length")
        heads = _positive(gguf, "attention.head_count")
        kv_heads = _first(gguf.arch_get("attention.head_count_kv", heads))
        # head_dim: key_length where the file has it (Qwen3, Gemma: not hidden / heads)
        head_dim = _first(gguf.arch_get("attention.key_length", hidden // heads))
        value_dim = _first(gguf.arch_get("attention.value_length", head_dim))
        if kv_heads <= 0 or heads % kv_heads or head_dim <= 0 or value_dim != head_dim:
            raise GGUFError(f"{gguf.path}: bad attention shape (heads={heads}, kv_heads={kv_heads}, "
                            f"key_length={head_dim}, value_length={value_dim})")
        tokens = gguf.get("tokenizer.ggml.tokens")
        vocab = int(gguf.arch_get("vocab_size", len(tokens) if tokens is not None else 0))
        return cls(path=gguf.path, name=gguf.name, architecture=arch,
                   num_layers=_positive(gguf, "block_count"), hidden_size=hidden, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim,
                   context_length=_positive(gguf, "context_length"), vocab_size=vocab,
                   long_rope_context=long_rope_context(gguf))


def long_rope_context(gguf: GGUFFile) -> int:
    """A LongRoPE file's original context (`rope.scaling.original_context_length`, default
    `context_length`, as the worker reads it); 0 when the file has no LongRoPE tables."""
    if not (LONG_ROPE_FACTORS in gguf.tensors and SHORT_ROPE_FACTORS in gguf.tensors):
        return 0
    value = gguf.arch_get("rope.scaling.original_context_length", gguf.arch_get("context_length"))
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 24:
        raise GGUFError(f"{gguf.path}: LongRoPE without a sensible original context ({value!r})")
    return value


def model_long_rope_context(path: str) -> int:
    """long_rope_context of the GGUF at `path` (0 for an unmaterialized `synthetic:` name: the
    generator writes no LongRoPE tables)."""
    if path.startswith(SYNTHETIC_PREFIX):
        return 0
    return long_rope_context(GGUFFile(resolve_model_path(path)))


def _first(value: object) -> int:
    """A count that converters may store per layer (an array): its first entry."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else 0
    return int(value) if isinstance(value, int) else 0


def _positive(gguf: GGUFFile, suffix: str) -> int:
    value = gguf.arch_get(suffix)
    if not isinstance(value, int) or value <= 0 or value > 1 << 24:
        raise GGUFError(f"{gguf.path}: metadata {gguf.architecture}.{suffix} is missing or "
                        f"absurd ({value!r})")
    return value


def model_sampling_defaults(gguf: GGUFFile) -> dict[str, float]:
    """The sampling defaults the GGUF carries, by SamplingParams field name. A value that is
    missing, or that a request could not carry (not a number, out of range), is left out."""
    out: dict[str, float] = {}
    for name, key in GGUF_SAMPLING_KEYS.items():
        value = gguf.get(key)
        if isinstance(value, float):
            value = float(f"{value:.6g}")  # stored as float32: 0.7 reads 0.699999988
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError):
            continue
        out[name] = value
    return out


GGUF_POOLINGS = {1: "mean", 2: "cls", 3: "last"}
"""The GGUF's `{arch}.pooling_type` (llama.cpp's enum: 0 none, 4 rank) -> our pooling."""
MATRYOSHKA_FAMILIES = ("qwen3-embedding",)
"""Embedding models trained with Matryoshka representation learning (their model cards give
output sizes from 32 to the hidden size), matched in the GGUF's general.name / basename."""


def model_pooling(gguf: GGUFFile, choice: str = "auto") -> str:
    """The pooling /v1/embeddings uses ("" none): `choice` (ModelConfig.pooling) unless auto,
    then the file's pooling_type."""
    if choice != "auto":
        return "" if choice == "none" else choice
    value = gguf.arch_get("pooling_type")
    return GGUF_POOLINGS.get(value, "") if isinstance(value, int) else ""


def is_matryoshka(gguf: GGUFFile, choice: str = "auto") -> bool:
    """May /v1/embeddings truncate to `dimensions`? (ModelConfig.matryoshka)"""
    if choice != "auto":
        return choice == "on"
    names = " ".join(str(gguf.get(key) or "") for key in ("general.name", "general.basename"))
    return any(family in names.lower() for family in MATRYOSHKA_FAMILIES)


def resolve_model(model: str) -> str:
    """'' -> default GGUF; 'synthetic:SPEC' -> a generated random-weight GGUF; else the path."""
    if model.startswith(SYNTHETIC_PREFIX):
        return _materialize_synthetic(model)
    return resolve_model_path(model)


def _materialize_synthetic(spec: str) -> str:
    # The generator lives with the other weight code in workers/; run it as a tool so the
    # control plane does not import the data plane.
    result = subprocess.run([sys.executable, "-m", "workers.weights.synthetic", spec],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise GGUFError(f"bad synthetic model spec {spec!r}: {lines[-1] if lines else 'failed'}")
    return result.stdout.strip().splitlines()[-1]
