"""The 4-bit weight-only matmul (quant_linear.py) against dequantize-then-matmul.

Tolerance, derived from the kernel's arithmetic (CPU: bf16 activations, bf16 scale and zero per
group, fp32 fused multiply-adds, bf16 output; tinygemm on CUDA does the same). With u = 2^-9
(bf16 rounding), e = 2^-24 (fp32), s = d and z = m + 8d a group's scale and zero, and codes
c in 0..15 (|c - 8| <= 8), each dequantized weight is off by at most
    e_w = 8u|s| + u|z| (+ a few e for the fp32 fused multiply-adds),
each activation by u|x|, the fp32 sum over K' = planes * K terms by gamma = K'e / (1 - K'e)
times the sum of |products|, and the output by u|y|. So, per output element,
    |y_kernel - y| <= |x| @ e_w + (2u + gamma) * |x| @ (|w_planes| + e_w)      (x 1.01 for
second-order terms). tinygemm (CUDA) also rounds each dequantized weight to bf16 for the tensor
cores: one more u there (`bf16_weights`). A negative control shows the bound is tight enough to
catch a wrong layout.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from workers.weights.kquant_pack import quantize
from workers.model.forward import Linear
from workers.weights.block_linear import BlockLinear, StackLinear
from workers.weights.block_matrix import RowStack, block_matrix
from workers.weights.path_plan import PathPlan
from workers.weights.paths import WeightPaths
from workers.weights.quant_blocks import GROUP_SIZE, QuantMatrix, _pack, quant_matrix
from workers.weights.quant_linear import Int4Linear, QuantKernelError

Q = GGMLQuantizationType
U_BF16 = 2.0 ** -9
EPS_FP32 = 2.0 ** -24


def error_bound(matrix: QuantMatrix, x: torch.Tensor, bf16_weights: bool = False) -> torch.Tensor:
    """The bound above for x [rows, in] -> [rows, out], in float64."""
    d, m = matrix.d.double(), matrix.m.double()
    scale, zero = d.abs(), (m + 8 * d).abs()  # per group: [out, planes * in / 32]
    e_w = (8 * scale + zero) * (U_BF16 + 4 * EPS_FP32)
    rows = matrix.shape[0]
    groups = matrix.codes().view(rows, -1, GROUP_SIZE).double()
    w_planes = (groups * d[:, :, None] + m[:, :, None]).abs()  # [out, groups, 32]
    e_w_full = e_w[:, :, None].expand_as(w_planes)

    def planes_sum(t: torch.Tensor) -> torch.Tensor:  # [out, groups, 32] -> [out, in], |.| summed
        return t.reshape(rows, matrix.num_planes, -1).sum(dim=1)

    k_terms = matrix.num_planes * matrix.shape[1]
    gamma = k_terms * EPS_FP32 / (1 - k_terms * EPS_FP32)
    ax = x.double().abs()
    roundings = (3 if bf16_weights else 2) * U_BF16 + gamma
    return 1.01 * (ax @ planes_sum(e_w_full).T + roundings * ax @ planes_sum(w_planes + e_w_full).T)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of rows whose 32-value groups span several orders of magnitude."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, cols // 32)).repeat(32, 1))
    return quantize(w.astype(np.float32), qtype)


def random_matrix(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> QuantMatrix:
    return quant_matrix(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))


PLANE_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K]


@pytest.mark.parametrize("qtype", PLANE_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernel_equals_dequantized_matmul_within_the_derived_bound(qtype, rows):
    cols = 256 if qtype.name.endswith("_K") else 96  # K-quant rows are 256-value blocks
    matrix = random_matrix(qtype, 40, cols, seed=rows)  # 40 outputs: padded to 48 inside
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    y = Int4Linear(matrix)(x)
    reference = x.double() @ matrix.dense().double().T
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    error = (y.double() - reference).abs()
    bound = error_bound(matrix, x)
    assert bool((error <= bound).all()), f"worst error/bound {(error / bound).max():.3f}"
    assert (error / bound).max() > 1e-3  # the bound is not vacuous: the kernel does round


def test_bound_catches_a_wrong_code_layout():
    matrix = random_matrix(Q.Q4_1, 32, 64, seed=7)
    codes = matrix.codes()
    swapped = QuantMatrix(_pack(codes.view(32, -1, 2).flip(-1).reshape(32, -1)), matrix.d, matrix.m,
                          1, "Q4_1")  # neighbouring codes exchanged: what a nibble-order bug does
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    error = (Int4Linear(swapped)(x).double() - x.double() @ matrix.dense().double().T).abs()
    assert bool((error > error_bound(matrix, x)).any())


def _exact_matrix(num_planes: int, rows: int = 16, cols: int = 64) -> QuantMatrix:
    """Scales and zeros that bf16 holds exactly (d = 2^k * (1 + j/8), m + 8d = t/4)."""
    gen = torch.Generator().manual_seed(num_planes)
    groups = num_planes * cols // GROUP_SIZE
    codes = torch.randint(0, 16, (rows, num_planes * cols), generator=gen, dtype=torch.uint8)
    d = 2.0 ** torch.randint(-6, 2, (rows, groups), generator=gen) * (1 + torch.randint(0, 8, (rows, groups), generator=gen) / 8)
    m = -8 * d + torch.randint(-8, 8, (rows, groups), generator=gen) / 4
    return QuantMatrix(_pack(codes), d.float(), m.float(), num_planes, "test")


@pytest.mark.parametrize("num_planes", [1, 2])
def test_kernel_is_exact_where_bf16_holds_every_input(num_planes):
    """bf16-exact scales, zeros and activations, dyadic products: the kernel's fp32 sum is
    exact, so the output is the reference rounded once to bf16."""
    matrix = _exact_matrix(num_planes)
    x = torch.randint(-16, 16, (3, 64), generator=torch.Generator().manual_seed(1)).float() / 8
    reference = x.double() @ matrix.dense().double().T
    assert torch.equal(Int4Linear(matrix)(x), reference.to(torch.bfloat16).float())


def test_weight_paths_make_the_linear_of_each_mode():
    blocks = {t: block_matrix(random_blocks(t, 16, 256), t, (16, 256)) for t in (Q.Q4_K, Q.Q6_K)}
    q4 = random_matrix(Q.Q4_0, 16, 64)
    assert isinstance(WeightPaths("fp32")(q4), Linear)
    assert isinstance(WeightPaths("q4")(q4), Int4Linear)
    assert isinstance(WeightPaths("q4")(torch.zeros(16, 64)), Linear)  # a dense type stays dense
    assert isinstance(WeightPaths("q4")(blocks[Q.Q4_K]), Int4Linear)  # repacked: exact in planes
    plan = PathPlan(((4, "int8"), (64, "dense")))
    auto = WeightPaths("auto", plan=plan)
    for matrix in blocks.values():
        linear = auto(matrix)
        assert isinstance(linear, BlockLinear) and linear.plan == plan
        kept = linear.matrix  # a PACKABLE type: a packed copy where the kernels read one (kquant_packed.h)
        assert kept is matrix or (kept.packed and torch.equal(kept.dense(), matrix.dense()))
    assert isinstance(WeightPaths("q4", plan=plan)(blocks[Q.Q6_K]), BlockLinear)  # no 4-bit planes
    stacked = auto(RowStack((blocks[Q.Q4_K], blocks[Q.Q6_K], torch.zeros(3, 256))))
    assert isinstance(stacked, StackLinear) and stacked.out_features == 35
    assert [type(p) for p in stacked.parts] == [BlockLinear, BlockLinear, Linear]
    assert {auto.form(t) for t in (Q.Q4_0, Q.Q5_1, Q.Q2_K, Q.Q6_K)} == {"blocks"}
    assert auto.form(Q.F16) == WeightPaths("fp32").form(Q.Q4_K) == "dense"
    assert (WeightPaths("q4").form(Q.Q5_K), WeightPaths("q4").form(Q.Q3_K)) == ("planes", "blocks")
    with pytest.raises(ValueError, match="weights must be one of .* got 'int4'"):
        WeightPaths("int4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_without_a_gpu_q4_fails_clearly_and_auto_runs_fp32():
    with pytest.raises(QuantKernelError, match="no int4 weight-only kernel on device cuda.*--weights fp32"):
        WeightPaths("q4", "cuda")
    with pytest.raises(QuantKernelError, match="device cuda"):
        Int4Linear(random_matrix(Q.Q4_0, 16, 64), "cuda")
    assert WeightPaths("auto", "cuda").mode == "fp32"
