"""Shared pytest fixtures: tiny synthetic GGUF models and the default SmolLM2 GGUF.

Keep fixtures here generic (several test modules use them); module-specific ones stay local.
"""
from __future__ import annotations

import os
from typing import Callable

import pytest

from justapi.model.gguf_file import GGUFError, default_model_path


def _interpret_triton_without_a_gpu() -> None:
    """Triton decides whether its kernels compile or run in its CPU interpreter as they are
    defined (its own library: when triton is first imported), so the choice is made here,
    before any test module imports it: the interpreter where torch sees no GPU (the Triton
    attention tests run on CPU), compiled kernels where it does."""
    import torch

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_a_gpu()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: tiny_gguf(layers=2, hidden=64, type="Q8_0", ...) -> path of a random llama GGUF
    (workers.weights.synthetic.SyntheticSpec fields). Each distinct spec is written once per session."""
    from workers.weights.synthetic import SyntheticSpec, write_synthetic_gguf

    directory = tmp_path_factory.mktemp("gguf")
    written: dict[SyntheticSpec, str] = {}

    def make(**fields: object) -> str:
        spec = SyntheticSpec(**fields)  # type: ignore[arg-type]
        if spec not in written:
            path = str(directory / f"tiny-{len(written)}.gguf")
            write_synthetic_gguf(path, spec)
            written[spec] = path
        return written[spec]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1); skips where it is not installed."""
    try:
        return default_model_path()
    except GGUFError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
