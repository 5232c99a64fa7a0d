"""Which GGUF tensor types each `--weights` mode keeps in the file's form, and the start-up
refusal of a file that a mode would expand to fp32 (the IQ types without a kernel: ~8x the
file in memory, and slower, with no word).

The CPU block kernels (workers/model/csrc/quant_matmul.c) read BLOCK_TYPE_NAMES in place;
`--weights auto` and `q4` on CPU keep those, and a matrix of any other quantized type would be
expanded, so the file is refused in one line naming the type and `--weights fp32` (which
expands every tensor on purpose). On a GPU, auto keeps the device kernels' types in device
memory (workers/weights/triton_blocks.py, IQ4_NL and IQ4_XS included) and dequantizes the rest
to bf16, as every other GPU mode does (docs/quantization.md): no refusal there.
Owns: the type lists and the check. Does not own: loading or kernels (workers/weights/).
"""
from __future__ import annotations

from collections import Counter

from justapi.model.gguf_file import GGUFError, GGUFFile

BLOCK_TYPE_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                    "IQ4_NL", "IQ4_XS")
"""GGUF types the CPU block kernels multiply in place (the memory is the file's)."""
FLOAT_TYPE_NAMES = ("F32", "F16", "BF16", "F64")
"""Types that are not quantized: kept dense by every mode (at most 2x a 16-bit file)."""
KEEPING_MODES = ("auto", "q4")
"""The `--weights` modes that keep quantized matrices in the file's form on CPU."""


def _type_name(tensor_type: object) -> str:
    return getattr(tensor_type, "name", str(tensor_type))


def expanded_types(gguf: GGUFFile) -> Counter[str]:
    """Quantized matrices (2-d and up) of a type no kernel reads: type name -> tensor count."""
    return Counter(name for tensor in gguf.tensors.values()
                   if len(tensor.shape) >= 2 and sum(int(d) > 1 for d in tensor.shape) >= 2
                   and (name := _type_name(tensor.tensor_type)) not in BLOCK_TYPE_NAMES + FLOAT_TYPE_NAMES)


def check_weight_types(gguf: GGUFFile, weights: str, device: str) -> None:
    """GGUFError (one line) if `weights` on `device` would expand some quantized matrix of
    `gguf` to fp32 where the mode promises to keep the file's form."""
    if weights not in KEEPING_MODES or not device.startswith("cpu"):
        return
    found = expanded_types(gguf)
    if not found:
        return
    listed = ", ".join(f"{name} ({count} tensors)" for name, count in sorted(found.items()))
    raise GGUFError(f"{gguf.path}: {listed}: --weights {weights} has no kernel for this type and "
                    f"would expand it to fp32 (~8x the file in memory); load it with --weights fp32, "
                    f"or use a file of {', '.join(BLOCK_TYPE_NAMES)}")
