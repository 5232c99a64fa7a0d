"""What the forward needs of a linear layer, as a protocol, and the type of a factory of them.

Implemented by forward.Linear (dense, oneDNN) and the kernels of workers/weights/quant_linear.py;
used by forward.py and ffn.py. Owns: the interface only.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from workers.weights.quant_blocks import Matrix


class LinearLike(Protocol):
    """What the forward needs of a linear layer: Linear, or the 4-bit kernels of quant_linear.py."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def warm_up(self, max_rows: int, min_rows: int = 1) -> None: ...


LinearFactory = Callable[[Matrix], LinearLike]
"""Makes the linear of one loaded weight (dense, or kept quantized: weight_paths.py)."""
