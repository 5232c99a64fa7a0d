"""GGUF blocks kept in device memory (workers/weights/triton_blocks.py, device_linear.py), in
Triton's CPU interpreter here and compiled on a GPU: every type's decode equals gguf's
dequantization bit for bit (whole matrices and row lookups), the in-kernel matmul and the
expanded-tile path equal x @ W.T of it (split over the input dimension or not, one tile or
several), each step's row count picks its path, a kernel that fails its start-up check leaves
its type dense, and a Q4_K_M model keeps its file's bytes and computes the dense model's logits."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from justapi.model.gguf_file import GGUFFile
from workers.weights.kquant_pack import dequantize, quantize

pytest.importorskip("triton")
from workers.model.triton_attention import is_interpreted  # noqa: E402
from workers.weights import triton_blocks  # noqa: E402
from workers.weights.block_matrix import BlockMatrix  # noqa: E402
from workers.weights.device_linear import DeviceBlockLinear, DeviceScratch, device_kernels_work  # noqa: E402
from workers.weights.triton_blocks import DEVICE_BLOCK_TYPES, block_matmul, expand_rows  # noqa: E402

Q = GGMLQuantizationType
DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not is_interpreted(),
                                reason="needs a GPU or Triton's interpreter (tests/conftest.py)")
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
"""The interpreter has no bf16 arithmetic: fp32 there (exact decode, ieee dots), bf16 on a GPU."""


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks [rows, bytes per row], gguf's fp32 dequantization [rows, cols])."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(values, qtype)).reshape(rows, -1)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, qtype, (rows, cols)))


def close(got: torch.Tensor, want: torch.Tensor, relative: float) -> bool:
    return float((got.float().cpu() - want).abs().max()) <= relative * float(want.abs().max())


@pytest.mark.parametrize("qtype", DEVICE_BLOCK_TYPES, ids=lambda t: t.name)
def test_every_type_decodes_and_multiplies_like_gguf(qtype, monkeypatch):
    raw, want = random_blocks(qtype, 40, 512)
    raw = raw.to(DEVICE)
    whole = expand_rows(raw, qtype, 512, torch.empty(40, 512, device=DEVICE))
    ids = torch.tensor([3, 0, 39, 3], device=DEVICE)
    rows = expand_rows(raw, qtype, 512, torch.empty(4, 512, device=DEVICE), ids)
    if DEVICE == "cpu":  # fp32 out, bit for bit (a GPU may fuse d * q - m into one FMA: 1 ulp)
        assert torch.equal(whole, want) and torch.equal(rows, want[ids])
    assert close(whole, want, 1e-6) and close(rows, want[ids.cpu()], 1e-6)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    reference = x.to(DTYPE).float() @ want.to(DTYPE).float().T
    tolerance = 1e-5 if DTYPE == torch.float32 else 2e-2
    assert close(block_matmul(x.to(DEVICE, DTYPE), raw, qtype, 512), reference, tolerance)
    monkeypatch.setattr(triton_blocks, "FORCED_SPLITS", 4)  # 2 chunks of 256: 2 splits
    split = block_matmul(x[:1].to(DEVICE, DTYPE), raw, qtype, 512)
    assert close(split, reference[:1], tolerance)


def test_the_row_count_picks_the_path_and_tiles_cover_the_matrix():
    """Fused at <= fused_rows rows, else expanded tiles (here 48 rows a tile over 80 rows: two,
    the second partial) multiplied densely; both give x @ W.T."""
    raw, want = random_blocks(Q.Q4_K, 80, 256, seed=2)
    matrix = BlockMatrix(raw, Q.Q4_K, 256).to(DEVICE, DTYPE)
    scratch = DeviceScratch(torch.device(DEVICE), max_bytes=48 * 256 * DTYPE.itemsize)
    linear = DeviceBlockLinear(matrix, scratch, DTYPE, fused_rows=3)
    assert scratch.rows_per_tile(80, 256, DTYPE) == 48
    tolerance = 1e-5 if DTYPE == torch.float32 else 2e-2
    for rows, path in ((1, "fused"), (3, "fused"), (4, "expand")):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        got = linear(x.to(DEVICE, DTYPE))
        assert got.dtype == DTYPE and linear.num_calls[path] == 1, (rows, linear.num_calls)
        linear.num_calls[path] = 0
        assert close(got, x.to(DTYPE).float() @ want.to(DTYPE).float().T, tolerance), rows
    with pytest.raises(ValueError, match="unknown device weight path"):
        linear.run("int8", x.to(DEVICE, DTYPE))


def test_kernels_refuse_blocks_they_do_not_read():
    raw, _ = random_blocks(Q.Q2_K, 4, 256)
    with pytest.raises(ValueError, match="no device kernel reads Q2_K"):
        expand_rows(raw, Q.Q2_K, 256, torch.empty(4, 256))
    raw, _ = random_blocks(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="do not hold rows of 96 values"):
        block_matmul(torch.zeros(1, 96), raw, Q.Q8_0, 96)


def test_a_failing_kernel_leaves_its_type_dense(monkeypatch, caplog):
    from workers.weights import device_linear

    device = torch.device(DEVICE)
    assert device_kernels_work(Q.Q8_0, device, DTYPE) and not device_kernels_work(Q.Q2_K, device, DTYPE)
    monkeypatch.setattr(device_linear, "block_matmul", lambda x, raw, qtype, cols: x[:, :48] * 0)
    device_linear.device_kernels_work.cache_clear()
    try:
        assert not device_kernels_work(Q.Q8_0, device, DTYPE)
        assert "failed their check" in caplog.text and "fused matmul at 1 rows" in caplog.text
    finally:
        device_linear.device_kernels_work.cache_clear()


def test_a_q4_k_m_model_keeps_its_file_bytes_and_the_dense_logits(tiny_gguf):
    """A Q4_K_M mix (Q4_K, Q6_K attn_v / ffn_down in some layers, a Q6_K head): every matrix
    stays blocks (RowStacks where fused parts differ in type), weights take <= 1.3x the file,
    and a mixed step's logits equal the same file's dense model."""
    from tests.workers.test_model_reference import BLOCK_SIZE, NUM_BLOCKS, Seqs, all_row_logits
    from workers.kv.pool import KVPool, PoolShape
    from workers.model.backends import make_backend
    from workers.runner import ModelRunner
    from workers.weights.paths import load_model

    path = tiny_gguf(type="Q4_K_M", layers=2, hidden=256, heads=4, kv_heads=2, ffn=256, vocab=320,
                     tied=False)
    gguf = GGUFFile(path)
    types = {name: info.tensor_type.name for name, info in gguf.tensors.items()}
    assert types["output.weight"] == "Q6_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["blk.1.attn_q.weight"] == "Q4_K"
    logits = {}
    for kept in (True, False):
        model = load_model(gguf, DEVICE, DTYPE, "auto" if kept else "fp32", progress=False,
                           device_blocks=kept)
        if kept:
            assert weight_bytes(model) <= 1.3 * os.path.getsize(path)
            assert isinstance(model.output, DeviceBlockLinear)
        p = model.params
        pool = KVPool.create(PoolShape(p.num_layers, NUM_BLOCKS, BLOCK_SIZE, p.num_kv_heads, p.head_dim),
                             "local", DTYPE, DEVICE)
        runner = ModelRunner(model, pool, make_backend(DEVICE, BLOCK_SIZE, (p.num_heads, p.num_kv_heads, p.head_dim)))
        seqs = Seqs({"a": 21, "b": 1}, vocab=320, seed=4)
        logits[kept] = all_row_logits(runner, 1, [seqs.chunk("a", 0, 21), seqs.chunk("b", 0, 1)],
                                      [seqs.new("a"), seqs.new("b")])
    for got, want in zip(logits[True], logits[False]):
        assert close(got, want.float().cpu(), 1e-4 if DTYPE == torch.float32 else 3e-2)


def weight_bytes(model) -> int:
    """Bytes of every weight the model keeps: blocks, dense matrices, norms (shared ones once)."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is not None:
            seen[t.data_ptr()] = t.numel() * t.element_size()

    def add_linear(linear) -> None:
        for part in getattr(linear, "parts", [linear]):
            add(part.matrix.raw if isinstance(part, DeviceBlockLinear) else part.weight)

    add(model.token_embd.raw if isinstance(model.token_embd, BlockMatrix) else model.token_embd)
    add_linear(model.output)
    add(model.output_norm)
    for layer in model.layers:
        for linear in layer.linears():
            add_linear(linear)
        add(layer.attn_norm)
        add(layer.ffn_norm)
    return sum(seen.values())
