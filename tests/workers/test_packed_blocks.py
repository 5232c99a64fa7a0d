"""Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 blocks packed with rows interleaved by 8 (csrc/kquant_packed.h, made at load by
BlockKernels.pack): every kernel that reads the packed copy gives the bits it gives on the
file's layout - the int8 path at any row count, the panels (16-row panels, each tile read
back), the AVX2-only build, expansion and row lookups - and the matmul stays within the int8
bound of the dequantized product. Types and shapes without a packed layout stay as they are.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from workers.model.cpu_kernels import build, cpu_id
from workers.weights.block_kernels import PACKED, BlockKernels, block_kernels
from workers.weights.block_matrix import block_matrix, packed_copy
from workers.weights.kquant_pack import dequantize, quantize

Q = GGMLQuantizationType
NO_VNNI = ("-mno-avx512f", "-mno-avxvnni", "-mno-avx512vnni")
pytestmark = pytest.mark.skipif(block_kernels() is None or not block_kernels().has_packed,
                                reason="the packed layout needs the block kernels with AVX2 and F16C")
CASES = [(qtype, cols) for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) for cols in (256, 2304, 4096)] + \
    [(qtype, cols) for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0) for cols in (32, 96, 576, 1536)]  # SmolLM2's 576 = 18 blocks; 96: a block after the pairs


def matrices(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int):
    """(the file's layout, its packed copy, gguf's fp32 values)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, cols // 32)).repeat(32, 1))
    blocks = quantize(w.astype(np.float32), qtype)
    plain = block_matrix(blocks, qtype, (rows, cols))
    return plain, packed_copy(plain, block_kernels()), torch.from_numpy(dequantize(blocks, qtype, (rows, cols)))


def x_rows(count: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(count, cols, generator=torch.Generator().manual_seed(seed))
    x[1] *= 1e4
    x[2] = 0.0
    x[3, : cols // 2] *= 1e-3
    return x


@pytest.mark.parametrize("qtype,cols", CASES, ids=[f"{t.name}-{c}" for t, c in CASES])
def test_packed_blocks_give_the_file_layouts_bits_at_every_row_count(qtype, cols):
    kernels = block_kernels()
    plain, packed, values = matrices(qtype, 24, cols, seed=21)
    assert packed.packed and packed.kernel_type == int(qtype) | PACKED
    assert packed.num_bytes == plain.num_bytes and not torch.equal(packed.raw, plain.raw)
    x = x_rows(21, cols, seed=22)
    reference = kernels.matmul(plain, x, panels=True)  # 16-row panels with AVX-512 VNNI
    for rows in (1, 2, 3, 4, 5, 7, 9, 21):
        for panels in (False, True):
            got = kernels.matmul(packed, x[:rows], panels=panels)
            assert torch.equal(got, reference[:rows]), (rows, panels)
    assert torch.equal(kernels.matmul(packed, x[5:6])[0], reference[5])
    assert bool((reference[2] == 0).all())
    step = x.view(x.shape[0], -1, 32).abs().amax(-1).double() / 127
    moved = (step / 2 * (1 + 2 ** -20)).repeat_interleave(32, dim=1)
    bound = moved @ values.double().abs().T + 2 * cols * 2.0 ** -24 * ((x.abs() + moved.float()).double()
                                                                       @ values.double().abs().T)
    assert bool(((reference.double() - x.double() @ values.double().T).abs() <= bound).all())


TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q8_0]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_packed_blocks_expand_and_look_up_as_gguf(qtype):
    cols = 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 576
    plain, packed, values = matrices(qtype, 32, cols, seed=23)
    assert torch.equal(packed.dense(), values)
    bf16 = block_kernels().dequantize(packed.raw, qtype, cols, dtype=torch.bfloat16, packed=True)
    assert torch.equal(bf16, values.to(torch.bfloat16))
    assert torch.equal(block_kernels().dequantize(packed.raw[8:24], qtype, cols, packed=True), values[8:24])
    ids = torch.tensor([31, 0, 9, 9, 17])
    assert torch.equal(packed[ids], values[ids])
    with pytest.raises(ValueError):
        packed.map_rows(lambda raw: raw.flip(0))


@pytest.mark.skipif("avx512f" not in cpu_id(), reason="this CPU has no AVX-512: its build is already the AVX2 one")
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_an_avx2_builds_packed_kernel_gives_this_builds_bits(qtype):
    """maddubs + madd (AVX2 CPUs) in place of dpbusd: the same exact sums, the same bits."""
    fallback = BlockKernels(ctypes.CDLL(str(build("quant_matmul", NO_VNNI))))
    cols = 2304 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 608  # 19 blocks: a last one after the pairs
    _, packed, _ = matrices(qtype, 16, cols, seed=25)
    x = x_rows(6, cols, seed=26)
    for rows in (1, 2, 6):
        assert torch.equal(fallback.matmul(packed, x[:rows]), block_kernels().matmul(packed, x[:rows])), rows


CODE_BYTES = {Q.Q4_K: (16, 144), Q.Q5_K: (16, 176), Q.Q6_K: (0, 192), Q.Q4_0: (2, 18), Q.Q4_1: (4, 20)}
"""Where each block's code bytes lie (from, to): all ones there make every code its largest."""


@pytest.mark.parametrize("qtype", list(CODE_BYTES), ids=[t.name for t in CODE_BYTES])
def test_the_largest_codes_against_the_largest_x_lose_nothing(qtype):
    """Every code at its largest (15, 31, 63) times x's rows at +-127 in every group: the most a
    16-bit sum of the AVX2 build's runs of chunks can hold. Both builds give the exact
    dequantized product's value (within float rounding), and the same bits."""
    cols = 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96
    rng = np.random.default_rng(28)
    blocks = quantize(rng.standard_normal((8, cols)).astype(np.float32), qtype)
    start, end = CODE_BYTES[qtype]
    raw = blocks.view(np.uint8).reshape(8 * cols // (256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32), -1)
    raw[:, start:end] = 0xFF
    values = torch.from_numpy(dequantize(blocks, qtype, (8, cols)))
    packed = packed_copy(block_matrix(blocks, qtype, (8, cols)), block_kernels())
    x = torch.ones(6, cols)
    x[1] = -1.0
    x[3] = -3.0
    x[4, ::2] = -1.0  # (+-1 throughout: x's rounding exact, so the product is)
    expected = x.double() @ values.double().T
    builds = [block_kernels()]
    if "avx512f" in cpu_id():
        builds.append(BlockKernels(ctypes.CDLL(str(build("quant_matmul", NO_VNNI)))))
    for rows in (1, 2, 4, 6):
        got = [kernels.matmul(packed, x[:rows]) for kernels in builds]
        assert bool(torch.isclose(got[0].double(), expected[:rows], rtol=1e-5, atol=1e-3).all()), rows
        assert all(torch.equal(g, got[0]) for g in got[1:]), rows


def test_types_and_shapes_without_a_packed_layout_stay_as_they_are():
    kernels = block_kernels()
    for qtype, rows, cols in ((Q.Q4_K, 12, 256), (Q.Q5_K, 12, 256), (Q.Q8_0, 12, 64)):
        plain = matrices(qtype, rows, cols, seed=27)[0] if qtype != Q.Q8_0 else \
            block_matrix(quantize(np.ones((rows, cols), np.float32), qtype), qtype, (rows, cols))
        assert packed_copy(plain, kernels) is plain
    view = matrices(Q.Q4_K, 16, 256, seed=28)[0]
    half = type(view)(view.raw[:8], view.qtype, view.in_features)  # a view of a larger tensor: not copied
    assert packed_copy(half, kernels) is half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["dense", "dense_bf16"])
def test_the_dense_tiles_of_a_packed_matrix_are_the_file_layouts(dtype):
    """Large steps expand tiles of rows into the scratch (whole tiles of 8: ROW_MULTIPLE) and
    multiply densely: a packed matrix gives the same bits, split into several tiles too."""
    from workers.weights.block_linear import BlockLinear, TileScratch
    from workers.weights.path_plan import PathPlan

    plain, packed, _ = matrices(Q.Q6_K, 48, 512, seed=29)
    x = x_rows(5, 512, seed=30)
    path = "dense" if dtype == torch.float32 else "dense_bf16"
    runs = [BlockLinear(m, block_kernels(), PathPlan.only(path), TileScratch(16 * 512 * 4)).run(path, x)
            for m in (plain, packed)]
    assert torch.equal(runs[0], runs[1])


def test_q8_0_codes_over_the_whole_int8_range_give_the_file_layouts_bits():
    """Q8_0's codes are signed: packed, they enter the dot products as code + 128 (VNNI) or as
    |code| with x signed by the code (AVX2); -128, which gguf's quantizer never writes but a file
    may hold, too."""
    rng = np.random.default_rng(31)
    rows, cols = 16, 576
    blocks = np.zeros((rows, cols // 32, 34), np.uint8)
    blocks[:, :, :2] = np.frombuffer(rng.uniform(1e-3, 1e-2, (rows, cols // 32)).astype(np.float16).tobytes(),
                                     np.uint8).reshape(rows, cols // 32, 2)
    codes = rng.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8)
    codes[0, 0, :] = -128
    blocks[:, :, 2:] = codes.view(np.uint8)
    plain = block_matrix(blocks.reshape(rows, -1), Q.Q8_0, (rows, cols))
    packed = packed_copy(plain, block_kernels())
    assert packed.packed
    values = torch.from_numpy(dequantize(blocks.reshape(rows, -1), Q.Q8_0, (rows, cols)))
    assert torch.equal(packed.dense(), values)
    x = x_rows(6, cols, seed=32)
    fallback = BlockKernels(ctypes.CDLL(str(build("quant_matmul", NO_VNNI))))
    for count in (1, 2, 5, 6):
        want = block_kernels().matmul(plain, x[:count])
        assert torch.equal(block_kernels().matmul(packed, x[:count]), want), count
        assert torch.equal(fallback.matmul(packed, x[:count]), want), count
