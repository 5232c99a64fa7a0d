"""The CPU kernels over GGUF blocks (csrc/quant_matmul.c via block_kernels.py), per type, on
blocks made by workers/weights/kquant_pack.py (IQ4_NL, IQ4_XS: iq4_pack.py) from rows whose
32-value groups span orders of magnitude, against gguf's own decoder:

- expansion (fp32 and bf16) and lookups equal gguf's values bit for bit;
- the int8 matmul, and the same arithmetic by panels of 8 rows of x, equal x @ W.T within the
  rounding of x to 8 bits per 32 values: each x moves by at most half its group's step
  d = max |x| / 127, so |err| <= sum_groups d / 2 sum |w| (+ fp32 summation's bound on the
  rounded x, K u sum |x| |w|, u = 2^-24);
- a row of x gives the same bits alone as among others;
and negative controls show both bounds catch a code-order bug.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workers.weights.kquant_pack import dequantize, quantize
from workers.model.cpu_kernels import build, cpu_id
from workers.weights.block_kernels import BlockKernels, block_kernels
from workers.weights.block_matrix import BLOCK_TYPES, BlockMatrix, block_matrix

Q = GGMLQuantizationType
U = 2.0 ** -24
pytestmark = pytest.mark.skipif(block_kernels() is None, reason="no C compiler: block kernels unavailable")


def skip_without_panels(kernel: str) -> None:
    if kernel == "int8_panels" and not block_kernels().has_panels:
        pytest.skip("the int8 panels need AVX2")


def weights(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> tuple[BlockMatrix, torch.Tensor]:
    """(BlockMatrix, gguf's fp32 values of it)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, cols // 32)).repeat(32, 1))
    blocks = quantize(w.astype(np.float32), qtype)
    return block_matrix(blocks, qtype, (rows, cols)), torch.from_numpy(dequantize(blocks, qtype, (rows, cols)))


def has_super_blocks(qtype: GGMLQuantizationType) -> bool:
    return GGML_QUANT_SIZES[qtype][0] == 256  # the K-quants and IQ4_XS


def cols_for(qtype: GGMLQuantizationType) -> int:
    return 512 if has_super_blocks(qtype) else 160  # 160: five 32-blocks, not a power of two


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.shape[1] * U * (x.double().abs() @ w.double().abs().T)


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    step = x.view(x.shape[0], -1, 32).abs().amax(-1).double() / 127  # [rows, groups]
    moved = (step / 2 * (1 + 2 ** -20)).repeat_interleave(32, dim=1)  # [rows, in]
    return moved @ w.double().abs().T + 2 * fp32_bound(x.abs() + moved.float(), w)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=[t.name for t in BLOCK_TYPES])
def test_expansion_and_lookups_equal_gguf(qtype):
    matrix, reference = weights(qtype, 37, cols_for(qtype))
    kernels = block_kernels()
    assert torch.equal(matrix.dense(), reference)
    assert torch.equal(kernels.dequantize(matrix.raw, qtype, matrix.in_features), reference)
    bf16 = kernels.dequantize(matrix.raw, qtype, matrix.in_features, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, reference.to(torch.bfloat16))
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(matrix[ids], reference[ids])
    assert matrix.num_bytes == matrix.raw.numel() and matrix.raw.dtype == torch.uint8


KERNELS = {"int8": {}, "int8_panels": {"panels": True}}


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=[t.name for t in BLOCK_TYPES])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_matmul_equals_the_dequantized_product_within_its_bound(qtype, kernel):
    skip_without_panels(kernel)
    matrix, w = weights(qtype, 37, cols_for(qtype), seed=1)  # 37 rows: a partial tile of 4
    rows = 35 if kernel != "int8_panels" else 8 * 16 + 11  # past a pass (32 rows; 16 panels of 8) and a partial panel
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(2))
    x[3] *= 1000.0  # rows of very different magnitude
    y = block_kernels().matmul(matrix, x, **KERNELS[kernel])
    error = (y.double() - x.double() @ w.double().T).abs()
    bound = int8_bound(x, w)
    assert y.shape == (rows, 37) and y.dtype == torch.float32
    assert bool((error <= bound).all()), f"worst error/bound {float((error / bound).max()):.3f}"
    alone = block_kernels().matmul(matrix, x[rows - 2:rows - 1], **KERNELS[kernel])
    assert torch.equal(alone[0], y[rows - 2])  # the same bits without batch mates (and in lane 0)


@pytest.mark.parametrize("qtype,cols", [(Q.Q4_1, 2208), (Q.Q8_0, 2080), (Q.Q6_K, 2304)],
                         ids=["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("kernel", ["int8", "int8_panels"])
def test_int8_matmul_over_rows_longer_than_one_coded_piece(qtype, cols, kernel):
    """Rows past the int8 kernels' 2048-value piece: the accumulators carry across pieces, and
    the last, shorter piece's offsets do not reuse the previous piece's."""
    skip_without_panels(kernel)
    matrix, w = weights(qtype, 9, cols, seed=5)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(6))
    y = block_kernels().matmul(matrix, x, **KERNELS[kernel])
    error = (y.double() - x.double() @ w.double().T).abs()
    assert bool((error <= int8_bound(x, w)).all()), f"worst error/bound {float((error / int8_bound(x, w)).max()):.3f}"
    assert torch.equal(block_kernels().matmul(matrix, x[12:], **KERNELS[kernel])[0], y[12])


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_bounds_catch_codes_in_the_wrong_order(kernel):
    skip_without_panels(kernel)
    matrix, w = weights(Q.Q4_K, 8, 256, seed=3)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    swapped = w.view(8, -1, 2).flip(-1).reshape(8, 256)  # neighbours exchanged: a nibble-order bug
    error = (block_kernels().matmul(matrix, x, **KERNELS[kernel]).double() - x.double() @ swapped.double().T).abs()
    bound = int8_bound(x, swapped)
    assert bool((error > bound).any())


def test_bad_inputs_are_refused():
    matrix, _ = weights(Q.Q6_K, 4, 256)
    kernels = block_kernels()
    with pytest.raises(ValueError, match="does not match a 4x256 weight"):
        kernels.matmul(matrix, torch.zeros(2, 128))
    with pytest.raises(ValueError, match="row length is not whole blocks"):
        kernels.dequantize(matrix.raw[:, :105], Q.Q6_K, 128)  # half a block per row
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.dequantize(matrix.raw, Q.Q6_K, 256, dtype=torch.float16)


NO_VNNI = ("-mno-avx512f", "-mno-avxvnni", "-mno-avx512vnni")


@pytest.mark.skipif("vnni" not in cpu_id(), reason="this CPU has no VNNI: its build is already the fallback")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.Q4_K, Q.IQ4_NL, Q.IQ4_XS],
                         ids=["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q4_K", "IQ4_NL", "IQ4_XS"])
def test_int8_panels_give_the_same_bits_without_vnni(qtype):
    """The panels' integer sums are exact with dpbusd (Q8_0's codes shifted by 128, the shift
    taken back exactly) and with maddubs + madd (AVX2 CPUs, Q8_0 by signs): a build for a CPU
    without VNNI or AVX-512 gives the same bits, so both paths are checked on this machine."""
    fallback = BlockKernels(ctypes.CDLL(str(build("quant_matmul", NO_VNNI))))
    matrix, _ = weights(qtype, 21, 2048 + 8 * 32 + 32 * (not has_super_blocks(qtype)), seed=7)
    x = torch.randn(19, matrix.in_features, generator=torch.Generator().manual_seed(8))  # AVX-512: panels of 16
    assert torch.equal(fallback.matmul(matrix, x, panels=True), block_kernels().matmul(matrix, x, panels=True))


@pytest.mark.skipif("avx512f" not in cpu_id(), reason="this CPU has no AVX-512: its build is already the AVX2 one")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_direct_path_of_an_avx2_build_gives_this_builds_bits(qtype):
    """One to four rows of x read the blocks directly (maddubs + madd on AVX2, dpbusd with
    VNNI): an AVX2-only build, what a Zen 3 runs, gives the bits of this CPU's build."""
    fallback = BlockKernels(ctypes.CDLL(str(build("quant_matmul", NO_VNNI))))
    matrix, _ = weights(qtype, 13, 2304 if qtype.name.endswith("_K") else 2208, seed=15)
    x = torch.randn(4, matrix.in_features, generator=torch.Generator().manual_seed(16))
    x[1] *= 1e3
    for rows in (1, 2, 3, 4):
        assert torch.equal(fallback.matmul(matrix, x[:rows]), block_kernels().matmul(matrix, x[:rows])), rows


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.Q2_K, Q.IQ4_NL],
                         ids=["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q2_K", "IQ4_NL"])
def test_panels_of_16_rows_give_the_bits_of_panels_of_8(qtype):
    """With AVX-512 VNNI, calls of more than 8 rows take panels of 16 rows (x + 128 unsigned,
    the codes signed, each sum started at -128 times its codes' sum); up to 8 rows, panels of 8.
    Each row's bits are the same either way: every row of a 45-row call (three panels of 16,
    the last partial; 13 weight rows, a partial tile of 8) equals it in calls of 8, 3 and 1.
    Q8_0's codes include -128, the signed operand's edge."""
    skip_without_panels("int8_panels")
    cols = cols_for(qtype) + (0 if has_super_blocks(qtype) else 2048)  # past one piece, a short last one
    rng = np.random.default_rng(13)
    w = rng.standard_normal((13, cols)) * np.exp(rng.standard_normal((13, cols // 32)).repeat(32, 1))
    blocks = quantize(w.astype(np.float32), qtype)
    if qtype == Q.Q8_0:  # d | 32 int8: every fifth code of each block -> -128
        codes = blocks.reshape(-1, 34)[:, 2:]
        codes[:, ::5] = 0x80
        assert (codes.view(np.int8) == -128).any()
    matrix = block_matrix(blocks, qtype, (13, cols))
    x = torch.randn(45, cols, generator=torch.Generator().manual_seed(14))
    x[4] *= 1e4
    x[9] = 0.0
    kernels = block_kernels()
    y = kernels.matmul(matrix, x, panels=True)
    for rows in (8, 3, 1):
        for start in range(0, 45, rows):
            assert torch.equal(kernels.matmul(matrix, x[start:start + rows], panels=True), y[start:start + rows]), (rows, start)
    assert bool((y[9] == 0).all())
    values = torch.from_numpy(dequantize(blocks, qtype, (13, cols)))
    error = (y.double() - x.double() @ values.double().T).abs()
    assert bool((error <= int8_bound(x, values)).all())


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=[t.name for t in BLOCK_TYPES])
def test_int8_and_int8_panels_give_the_same_bits(qtype):
    """Both sum each group exactly in int32 and apply the same float operations in the same
    order per (weight row, x row), so a plan may switch between them with the step's row count
    without moving a bit: speculative verification and batches of any size compute a row as a
    lone decode step does (up to the dense path's range)."""
    skip_without_panels("int8_panels")
    matrix, _ = weights(qtype, 37, 2 * cols_for(qtype) + (0 if has_super_blocks(qtype) else 2048), seed=9)
    x = torch.randn(8 * 16 + 21, matrix.in_features, generator=torch.Generator().manual_seed(10))  # 2 passes
    x[5] *= 300.0
    per_row = block_kernels().matmul(matrix, x)
    assert torch.equal(block_kernels().matmul(matrix, x, panels=True), per_row)
    assert torch.equal(block_kernels().matmul(matrix, x[7:8])[0], per_row[7])


DIRECT_CASES = [(qtype, cols) for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.IQ4_NL) for cols in (160, 2208, 2048 + 64)] + \
    [(qtype, cols) for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) for cols in (256, 2304, 4096)]


@pytest.mark.parametrize("qtype,cols", DIRECT_CASES, ids=[f"{t.name}-{c}" for t, c in DIRECT_CASES])
def test_the_int8_path_for_a_few_rows_gives_the_panels_bits(qtype, cols):
    """One to four rows of x take these types' codes straight from the blocks (no coded copy
    in L1; IQ4_NL's nibbles looked up in its table in a register); five and more take the
    coded tiles. Every row count gives each row the panels' bits: odd group counts (a lone
    last block's offsets), rows past one 2048-value piece (K quants: 9 superblocks, and two
    whole pieces), a partial tile of weight rows, an all-zero row and rows of very different
    magnitude."""
    skip_without_panels("int8_panels")
    matrix, w = weights(qtype, 23, cols, seed=11)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(12))
    x[1] *= 1e4
    x[2] = 0.0
    x[3, : cols // 2] *= 1e-3
    reference = block_kernels().matmul(matrix, x, panels=True)
    assert bool((reference[2] == 0).all())
    for rows in range(1, 7):
        for start in range(0, 7 - rows):
            got = block_kernels().matmul(matrix, x[start:start + rows])
            assert torch.equal(got, reference[start:start + rows]), (rows, start)
    error = (reference.double() - x.double() @ w.double().T).abs()
    assert bool((error <= int8_bound(x, w)).all())
