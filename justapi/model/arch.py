"""The architectures we serve, as a table of what their GGUF files mean beyond tensor shapes.

One entry per `general.architecture` value (llama.cpp's converter and loader conventions):
how Q/K rows are stored, which norms and activations a layer has, which layers attend through
a sliding window, soft-capping, rope bases of local layers, and how experts are weighted.
Owns: that table (torch-free: the launcher refuses an unknown architecture from it).
Does not own: reading metadata (workers/weights/hparams.py) or the forward (workers/model/).
"""
from __future__ import annotations

from dataclasses import dataclass

from justapi.model.gguf_file import GGUFError


@dataclass(frozen=True)
class ArchTraits:
    """What differs between architectures that the file's metadata does not say itself."""

    permuted_qk: bool = False
    """Q/K rows stored in interleaved rotary pairs (llama.cpp permutes only `llama`): un-permute."""
    embedding_scale: bool = False
    """Token embeddings are multiplied by sqrt(hidden) (Gemma)."""
    activation: str = "silu"
    """Of the gated FFN: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    post_norms: bool = False
    """RMSNorm of the attention and FFN outputs before the residual add (Gemma 2/3)."""
    qk_norm: bool = False
    """Per-head RMSNorm of Q and K before rotary (Qwen3, Gemma 3)."""
    fused_gate_up: bool = False
    """`ffn_up` holds gate rows then up rows and there is no `ffn_gate` (Phi-3)."""
    swa_pattern: int | None = None
    """Sliding-window layers, llama.cpp's rule for period P: layer i slides iff P == 0 or
    i % P < P - 1 (0: every layer, as Mistral). None: the file's window is ignored."""
    default_window: int = 0
    """Window when the file has no `attention.sliding_window` key (Gemma 2: 4096)."""
    swa_rope_base: float | None = None
    """Rope base of sliding layers when the file has no `rope.freq_base_swa` (None: the global one)."""
    swa_rope_unscaled: bool = False
    """Sliding layers ignore linear rope scaling (Gemma 3)."""
    attn_softcap: float | None = None
    """Default attention logit soft-cap; None: the architecture has none (key ignored)."""
    final_softcap: float | None = None
    """Default final logit soft-cap; None: the architecture has none (key ignored)."""
    scale_by_hidden_at_layers: tuple[int, ...] = ()
    """Layer counts (Gemma 27B) whose attention scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim)."""
    expert_ffn_key: str = "feed_forward_length"
    """Metadata key of one expert's FFN width (llama MoE: the dense key; Qwen MoE: its own)."""
    experts_renormalized: bool = True
    """Top-k router weights divided by their sum (Mixtral, Qwen3-MoE; not Qwen2-MoE)."""
    shared_expert: bool = False
    """A shared expert beside the routed ones, gated by sigmoid(x . w) (Qwen2-MoE)."""


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(permuted_qk=True, swa_pattern=0),  # also Mistral (window) and Mixtral (experts)
    "qwen2": ArchTraits(),
    "qwen2moe": ArchTraits(expert_ffn_key="expert_feed_forward_length",
                           experts_renormalized=False, shared_expert=True),
    "qwen3": ArchTraits(qk_norm=True),
    "qwen3moe": ArchTraits(qk_norm=True, expert_ffn_key="expert_feed_forward_length"),
    "gemma2": ArchTraits(embedding_scale=True, activation="gelu_tanh", post_norms=True,
                         swa_pattern=2, default_window=4096, attn_softcap=50.0,
                         final_softcap=30.0, scale_by_hidden_at_layers=(46,)),
    "gemma3": ArchTraits(embedding_scale=True, activation="gelu_tanh", post_norms=True,
                         qk_norm=True, swa_pattern=6, swa_rope_base=10000.0,
                         swa_rope_unscaled=True, final_softcap=0.0,
                         scale_by_hidden_at_layers=(62,)),
    "phi3": ArchTraits(fused_gate_up=True),  # llama.cpp ignores Phi-3's sliding window too
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def arch_traits(architecture: str, path: str = "") -> ArchTraits:
    """The traits of `architecture`; GGUFError (one line, naming the supported ones) if unknown."""
    traits = ARCHITECTURES.get(architecture)
    if traits is None:
        where = f"{path}: " if path else ""
        raise GGUFError(f"{where}unsupported architecture {architecture!r} "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return traits
