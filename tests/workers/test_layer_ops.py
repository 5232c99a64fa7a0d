"""The CPU forward's fused small ops (workers/model/csrc/layer_ops.c via layer_ops.py) against
their torch forms: RMS norm, rotary embedding (whole and partial heads, token rows apart as in
the fused qkv output) and the gated activations; each row's bits alone equal its bits in a
batch; layouts a kernel does not read fall back (None)."""
from __future__ import annotations

import ctypes
import types

import pytest
import torch
import torch.nn.functional as F

from workers.model import forward
from workers.model.layer_ops import layer_ops

pytestmark = pytest.mark.skipif(layer_ops() is None, reason="no C compiler: layer kernels unavailable")
GEN = torch.Generator().manual_seed(0)
NO_F16C = ("-mno-avx512f", "-mno-f16c")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows,n", [(1, 576), (37, 100), (300, 640)])  # 300 x 640: threads split rows
def test_rms_norm_matches_torch_and_rows_alone(rows, n):
    x = torch.randn(rows, 2 * n, generator=GEN)[:, :n] * 3  # rows 2n apart
    w = torch.randn(n, generator=GEN)
    out = layer_ops().rms_norm(x, w, 1e-6)
    assert close(out, F.rms_norm(x, (n,), w, 1e-6))
    assert torch.equal(layer_ops().rms_norm(x[rows - 1:], w, 1e-6)[0], out[-1])
    assert not close(out, F.rms_norm(x, (n,), w.flip(0), 1e-6))  # the weight is applied per value


def rotary_case(dim: int, half: int, tokens: int = 5, heads: int = 6):
    """(x, cos, sin, the torch form's result): x token rows of a fused qkv output, (heads + 2) *
    dim apart; the first 2 * half dims of each head rotate."""
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=GEN)
    x = qkv[:, :heads * dim].view(tokens, heads, dim)
    angles = torch.randn(tokens, half, generator=GEN)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return x, cos, sin, torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], dim=-1)


@pytest.mark.parametrize("dim,half", [(64, 32), (64, 16)], ids=["whole", "partial"])
def test_rotary_matches_torch_on_fused_qkv_rows(dim, half):
    x, cos, sin, expected = rotary_case(dim, half)
    out = layer_ops().rotary(x, cos, sin)
    assert close(out, expected)
    assert torch.equal(forward.apply_rotary(x, cos, sin), out)  # the forward takes it
    assert torch.equal(layer_ops().rotary(x[2:3], cos[2:3], sin[2:3])[0], out[2])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 64])  # 64 x 1536: threads split rows
def test_act_mul_matches_torch(activation, rows):
    f = 1536
    x = torch.randn(rows, 2 * f, generator=GEN) * 4
    act = F.silu if activation == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
    out = layer_ops().act_mul(x, activation)
    assert torch.allclose(out, act(x[:, :f]) * x[:, f:], rtol=1e-5, atol=1e-5)  # 1 + tanh cancels near -1
    assert torch.equal(layer_ops().act_mul(x[-1:], activation)[0], out[-1])


def test_layouts_it_does_not_read_fall_back():
    ops = layer_ops()
    x = torch.randn(4, 8, generator=GEN)
    assert ops.rms_norm(x.T, torch.ones(4), 1e-6) is None  # values not contiguous
    assert ops.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert ops.act_mul(x.T, "silu") is None and ops.act_mul(x, "relu") is None
    heads = torch.randn(3, 4, 8, generator=GEN).transpose(0, 1)  # heads not within a token's row
    assert ops.rotary(heads, torch.ones(4, 1, 4), torch.zeros(4, 1, 4)) is None
    assert torch.equal(forward.rms_norm(x.T, torch.ones(4), 1e-6), F.rms_norm(x.T, (4,), torch.ones(4), 1e-6))


def test_store_kv_writes_each_rows_k_and_v_at_its_slot_like_index_copy():
    from workers.model.attention import TorchCpuBackend, TorchPagedBackend
    kv = torch.randn(2, 5, 4, 3, 8, generator=GEN)  # 20 slots of 3 heads x 8
    qkv = torch.randn(6, (9 + 3 + 3) * 8, generator=GEN)  # fused rows: k and v are views apart
    k = qkv[:, 9 * 8:12 * 8].view(6, 3, 8)
    v = qkv[:, 12 * 8:].view(6, 3, 8)
    slots = torch.tensor([7, 0, 19, 3, 12, 8])
    want = kv.clone()
    flat = want.view(2, -1, 3, 8)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)
    assert layer_ops().store_kv(kv, k, v, slots)
    assert torch.equal(kv, want)
    with pytest.raises(ValueError, match="outside the pool"):
        layer_ops().store_kv(kv, k, v, torch.tensor([7, 0, 20, 3, 12, 8]))
    assert torch.equal(kv, want)  # nothing written
    assert not layer_ops().store_kv(kv, k.double(), v.double(), slots)  # not fp32: the caller's torch form
    # the CPU backend takes it, and its result is the torch backend's
    meta = types.SimpleNamespace(slots=slots)
    other = kv.clone()
    TorchCpuBackend(4).write_kv(kv, k * 2, v * 3, meta)
    TorchPagedBackend(4).write_kv(other, k * 2, v * 3, meta)
    assert torch.equal(kv, other)


def test_store_kv_into_a_bf16_pool_rounds_as_torch_does():
    """Round to nearest, ties to even, infinities, signed zeros, subnormals: the bits of
    index_copy_ of k.to(torch.bfloat16); NaN stays NaN (torch's own NaN bits differ between its
    scalar and vector forms)."""
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, float("inf"),
                            -float("inf"), -0.0, 0.0, 1e-40, -3e-39, 3.4e38, float("nan")])
    values = torch.cat([special, torch.randn(6 * 3 * 8 * 2 - len(special), generator=GEN) * 100])
    k, v = values.view(2, 6, 3, 8)
    slots = torch.tensor([7, 0, 19, 3, 12, 8])
    kv = torch.zeros(2, 5, 4, 3, 8, dtype=torch.bfloat16)
    want = kv.clone()
    flat = want.view(2, -1, 3, 8)
    flat[0].index_copy_(0, slots, k.bfloat16())
    flat[1].index_copy_(0, slots, v.bfloat16())
    assert layer_ops().store_kv(kv, k, v, slots)
    assert torch.equal(kv.isnan(), want.isnan()) and int(kv.isnan().sum()) == 1
    assert torch.equal(kv.view(torch.int16)[~kv.isnan()], want.view(torch.int16)[~want.isnan()])
    assert kv.view(-1)[7 * 24:7 * 24 + 2].tolist() == [1.0, 1 + 2 ** -6]  # ties went to the even neighbour
    with pytest.raises(ValueError, match="outside the pool"):
        layer_ops().store_kv(kv, k, v, torch.tensor([7, 0, 20, 3, 12, 8]))
    assert not layer_ops().store_kv(kv.double(), k, v, slots)  # fp64: the caller's torch form


F16_SPECIAL = [1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -11 + 2 ** -30, 65504.0, 65519.0, 65520.0,
               -65536.0, 2 ** -24, 2 ** -25, 3 * 2 ** -25, -(2 ** -14 - 2 ** -25), 2 ** -26, float("inf"), -0.0, 0.0,
               1e-40, 3.4e38, float("nan")]
"""Ties to even, the largest half and the first values that round to infinity, subnormal halves
and their ties, values that round to zero or up to the smallest normal, infinities, signed zeros."""


@pytest.mark.parametrize("build", ["native", "without F16C"])
def test_store_kv_into_a_f16_pool_rounds_as_torch_does(build):
    """--kv-cache-dtype float16: the bits of index_copy_ of k.to(torch.float16), with F16C's
    conversions (8 values a vector, then one by one) and with the plain C ones of CPUs without
    F16C; NaN stays NaN."""
    from workers.model.cpu_kernels import build as build_kernel
    from workers.model.layer_ops import LayerOps

    ops = layer_ops() if build == "native" else LayerOps(ctypes.CDLL(str(build_kernel("layer_ops", NO_F16C))))
    special = torch.tensor(F16_SPECIAL)
    values = torch.cat([special, torch.randn(6 * 3 * 9 * 2 - len(special), generator=GEN) * 1000,
                        torch.tensor([2.0]) ** torch.arange(-30, 20)])[:6 * 3 * 9 * 2]
    k, v = values.view(2, 6, 3, 9)  # 27 values a slot: three vectors of 8 and three one by one
    slots = torch.tensor([7, 0, 19, 3, 12, 8])
    kv = torch.zeros(2, 5, 4, 3, 9, dtype=torch.float16)
    want = kv.clone()
    flat = want.view(2, -1, 3, 9)
    flat[0].index_copy_(0, slots, k.half())
    flat[1].index_copy_(0, slots, v.half())
    assert ops.store_kv(kv, k, v, slots)
    assert torch.equal(kv.isnan(), want.isnan()) and int(kv.isnan().sum()) == 1
    assert torch.equal(kv.view(torch.int16)[~kv.isnan()], want.view(torch.int16)[~want.isnan()])
    stored = kv.view(-1)[7 * 27:7 * 27 + 8].tolist()
    assert stored[:2] == [1.0, 1 + 2 ** -9] and stored[4:7] == [65504.0, 65504.0, float("inf")]
    with pytest.raises(ValueError, match="outside the pool"):
        ops.store_kv(kv, k, v, torch.tensor([7, 0, 20, 3, 12, 8]))


@pytest.mark.parametrize("rows,n", [(1, 576), (300, 640)])  # 300 x 640: threads split rows
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(rows, n):
    x = torch.randn(rows, 2 * n, generator=GEN)[:, :n] * 3  # rows 2n apart
    d = torch.randn(rows, n, generator=GEN)
    w = torch.randn(n, generator=GEN)
    total, out = layer_ops().add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(total, x + d)
    assert torch.equal(out, layer_ops().rms_norm(x + d, w, 1e-6))
    assert torch.equal(forward.add_rms_norm(x, d, w, 1e-6)[1], out)  # the forward takes it
    assert layer_ops().add_rms_norm(x, None, w, 1e-6) is None
