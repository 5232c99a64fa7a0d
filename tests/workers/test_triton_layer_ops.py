"""The GPU forward's fused small ops (workers/model/triton_layer_ops.py), run in Triton's CPU
interpreter, against their torch forms in float64: the residual add with the RMS norm after it,
rotary embedding (whole and partial heads, token rows apart as in the fused qkv output), the
gated activations; half precision rounds once; layouts a kernel does not read fall back (None);
and a whole forward through them equals the torch forms' forward. Where a GPU is seen (or
JUSTAPI_TEST_GPU_DEVICE names one) the compiled kernels run them on it."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.workers.test_layer_ops import rotary_case

pytest.importorskip("triton")
from workers.model.triton_attention import is_interpreted  # noqa: E402
from workers.model.triton_layer_ops import TritonLayerOps  # noqa: E402

DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not is_interpreted(), reason="runs the kernels on "
                                "a GPU or in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)")
GEN = torch.Generator().manual_seed(0)


class OnDevice:
    """The kernels with CPU tensors in and out, run on DEVICE (a copy there is contiguous: the
    row-stride cases then test the interpreter only)."""

    def __getattr__(self, name: str):
        method = getattr(TritonLayerOps(), name)

        def call(*args):
            out = method(*[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args])
            if isinstance(out, tuple):
                return tuple(t.cpu() for t in out)
            return out if out is None else out.cpu()
        return call


OPS = TritonLayerOps() if DEVICE == "cpu" else OnDevice()


def norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("rows,n", [(1, 576), (5, 100)])
def test_add_rms_norm_matches_float64(rows, n):
    x = torch.randn(rows, 2 * n, generator=GEN)[:, :n] * 3  # rows 2n apart
    d = torch.randn(rows, n, generator=GEN)
    w = torch.randn(n, generator=GEN)
    total, out = OPS.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(total, x + d)
    assert torch.allclose(out.double(), norm64(x + d, w, 1e-6), rtol=1e-5, atol=1e-5)
    alone = OPS.rms_norm(x, w, 1e-6)
    assert torch.allclose(alone.double(), norm64(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone, F.rms_norm(x, (n,), w.flip(0), 1e-6), atol=1e-3)  # w per value


def test_half_precision_norm_rounds_the_sum_like_torch_and_the_norm_once():
    x = (torch.randn(3, 64, generator=GEN) * 4).half()
    d = torch.randn(3, 64, generator=GEN).half()
    w = torch.randn(64, generator=GEN).half()
    total, out = OPS.add_rms_norm(x, d, w, 1e-6)
    assert total.dtype == out.dtype == torch.float16
    assert torch.equal(total, x + d)  # the residual stream is what torch's add gives
    want = norm64(total.float(), w.float(), 1e-6).half()
    if DEVICE == "cpu":
        assert torch.equal(out, want)
    else:  # the GPU's sqrt may round the last bit its own way
        assert torch.allclose(out.float(), want.float(), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("dim,half", [(64, 32), (64, 16)], ids=["whole", "partial"])
def test_rotary_matches_torch_on_fused_qkv_rows(dim, half):
    x, cos, sin, expected = rotary_case(dim, half)
    out = OPS.rotary(x, cos, sin)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[..., 2 * half:], x[..., 2 * half:])
    if DEVICE == "cpu":  # (a copy to a GPU is contiguous)
        assert OPS.rotary(x.transpose(1, 2), cos, sin) is None  # dims not contiguous: torch's form


@pytest.mark.parametrize("activation,act", [("silu", F.silu),
                                            ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))])
def test_act_mul_matches_torch(activation, act):
    rows, f = 3, 1536 + 40  # two programs per row, the second partial
    x = torch.randn(rows, 2 * f, generator=GEN) * 3
    out = OPS.act_mul(x, activation)
    expected = act(x[:, :f].double()) * x[:, f:].double()
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert OPS.act_mul(x, "relu") is None


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors through the kernels (on a GPU: test_triton_shapes.py)")
def test_a_forward_through_the_kernels_equals_the_torch_forms(tiny_gguf, monkeypatch):
    """The same step of a 2-layer model with every small op in Triton and in torch (the
    forward takes the kernels on a GPU; here they are handed in on the CPU)."""
    from workers.engine import LLMEngine
    from workers.model import ffn, forward

    engine = LLMEngine(tiny_gguf(layers=2, vocab=320), device="cpu", num_blocks=16, progress=False)
    tokens = torch.tensor([5, 17, 3, 250, 9, 1], dtype=torch.int64)
    model = engine.model
    monkeypatch.setattr(forward, "ops_for", lambda device: None)
    monkeypatch.setattr(ffn, "ops_for", lambda device: None)
    want = model.logits(_forward(engine, tokens))
    counted = Counted()
    monkeypatch.setattr(forward, "ops_for", lambda device: counted)
    monkeypatch.setattr(ffn, "ops_for", lambda device: counted)
    got = model.logits(_forward(engine, tokens))
    # per layer: 2 add+norms, rotary, activation; then the head's norm (itself an add_rms_norm)
    assert counted.calls == {"add_rms_norm": 5, "rotary": 2, "act_mul": 2, "rms_norm": 1}
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


class Counted(TritonLayerOps):
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str):
        if name in ("add_rms_norm", "rotary", "act_mul", "rms_norm"):
            self.calls[name] = self.calls.get(name, 0) + 1
        return super().__getattribute__(name)


def _forward(engine, tokens: torch.Tensor) -> torch.Tensor:
    import numpy as np

    from workers.model.attention import AttentionBatch
    pool, backend = engine.pool, engine.runner.backend
    batch = AttentionBatch(np.array([0]), np.array([len(tokens)]), np.array([1]), np.array([0]),
                           pool.shape.block_size)
    kv_layers = [pool.layer(i) for i in range(pool.shape.num_layers)]
    with torch.inference_mode():
        return engine.model.forward(tokens, kv_layers, backend, backend.prepare(batch))
