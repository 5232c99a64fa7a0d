"""The in-place paged attention and KV-store Triton kernels (workers/model/triton_attention.py),
run in Triton's CPU interpreter, against a dense per-row reference and the gathered torch path:
scattered block tables, partial last blocks, decodes beside prefill chunks, token-tree
masks, GQA, half-precision KV, sliding window and soft-capping, padding rows. Shapes stay
small: the interpreter runs each program in numpy, one at a time. Where a GPU is seen (or
JUSTAPI_TEST_GPU_DEVICE names one) the same tests run the compiled kernels on it."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.workers.test_cpu_kernels import random_step
from workers.model.attention import AttentionBatch, TorchPagedBackend
from workers.model.paged_layout import pad_layout, paged_layout
from workers.spec.tree import TreeLayout, level_mask, verify_mask

pytest.importorskip("triton")
from workers.model.paged_backend import PagedMetadata, TritonPagedBackend  # noqa: E402
from workers.model.triton_attention import AttentionParams, is_interpreted, store_kv  # noqa: E402

DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not is_interpreted(), reason="runs the kernels on "
                                "a GPU or in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)")


def reference(batch: AttentionBatch, kv: torch.Tensor, q: torch.Tensor,
              params: AttentionParams) -> torch.Tensor:
    """Row by row in float64: the keys of the row's sequence at slot positions <= its own
    (tree rows: as their mask says), within the window, scores soft-capped."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv.shape[3]
    offsets = batch.token_offsets()
    for seq in range(batch.num_seqs):
        start, n = int(batch.start_positions[seq]), int(batch.num_tokens[seq])
        table = batch.padded_tables(np.array([seq]))[0]
        keys = np.arange(start + n)
        slots = table[keys // batch.block_size] * batch.block_size + keys % batch.block_size
        k = kv[0].reshape(-1, *kv.shape[3:])[slots].double()  # [keys, kv_heads, head_dim]
        v = kv[1].reshape(-1, *kv.shape[3:])[slots].double()
        visible = keys[None, :] <= start + np.arange(n)[:, None]  # [n, keys]
        if batch.tree:
            batch.tree.restrict_long(visible, seq)
        if params.window:
            visible &= (start + np.arange(n))[:, None] - keys[None, :] < params.window
        rows = q[offsets[seq]:offsets[seq + 1]].double()  # [n, heads, head_dim]
        scores = torch.einsum("nhd,khd->hnk", rows, k.repeat_interleave(group, 1)) * params.scale
        if params.softcap:
            scores = params.softcap * torch.tanh(scores / params.softcap)
        scores = scores.masked_fill(~torch.from_numpy(visible), float("-inf"))
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
        out[offsets[seq]:offsets[seq + 1]] = torch.einsum("hnk,khd->nhd", weights, v.repeat_interleave(group, 1))
    return out


def triton_attend(batch, kv, q, params=None):
    heads, kv_heads, head_dim = q.shape[1], kv.shape[3], q.shape[2]
    params = params or AttentionParams(head_dim ** -0.5)
    backend = TritonPagedBackend(batch.block_size, DEVICE, heads // kv_heads, params)
    return backend.attend(kv.to(DEVICE), q.to(DEVICE), backend.prepare(batch)).cpu()


def assert_close(got, want, tolerance=2e-6):
    assert got.shape == want.shape
    assert not torch.isnan(got).any()
    err = float((got.double() - want).abs().max())
    tolerance *= 1 if DEVICE == "cpu" else 5  # a GPU's exp and fused multiply-adds round otherwise
    assert err <= tolerance * max(1.0, float(want.abs().max())), err


SHAPES = [  # heads, kv_heads, head_dim, block_size
    (6, 2, 32, 16),   # GQA groups of 3 (SmolLM2's), 16-slot blocks
    (4, 4, 24, 4),    # no GQA, head_dim not a power of two, blocks smaller than a key tile
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_mixed_step_equals_the_reference(heads, kv_heads, head_dim, block_size):
    """Decodes at block boundaries and mid-block, a verification-sized chunk and a prefill
    chunk continuing earlier ones, in one launch, over scattered blocks."""
    batch, kv, q = random_step([0, 15, 33, 9, 40], [1, 1, 4, 30, 1], heads, kv_heads, head_dim,
                               block_size, seed=1)
    got = triton_attend(batch, kv, q)
    want = reference(batch, kv, q, AttentionParams(head_dim ** -0.5))
    assert_close(got, want)
    gathered = TorchPagedBackend(block_size, chunk_bytes=None)
    assert_close(got, gathered.attend(kv, q, gathered.prepare(batch)).double(), 5e-6)


def test_token_tree_rows_see_their_ancestors_only():
    """A verification tree and a draft model's level (its restriction starts before the chunk)."""
    parents = [-1, 0, 0, 1, 2]
    tree = TreeLayout()
    tree.add(verify_mask(seq=1, num_tokens=1 + len(parents), start=20, parents=parents))
    tree.add(level_mask(seq=2, parents=[-1, -1, 0, 1], first_node=2, num_nodes=2, root_position=30))
    batch, kv, q = random_step([7, 20, 33], [1, 1 + len(parents), 2], 6, 2, 32, 16, seed=2, tree=tree)
    got = triton_attend(batch, kv, q)
    assert_close(got, reference(batch, kv, q, AttentionParams(32 ** -0.5)))
    chain, _, _ = random_step([7, 20, 33], [1, 1 + len(parents), 2], 6, 2, 32, 16, seed=2)
    assert not torch.allclose(got[4], triton_attend(chain, kv, q)[4])  # node 2 no longer sees node 1


def test_window_softcap_and_scale_are_parameters():
    batch, kv, q = random_step([0, 37], [20, 1], 4, 2, 16, 8, seed=3)
    params = AttentionParams(scale=0.3, window=11, softcap=2.5)
    assert_close(triton_attend(batch, kv, q, params), reference(batch, kv, q, params))


@dataclass(frozen=True)
class LayerParams:
    """A model's per-layer attention fields (#18's shape of them), not the kernel's class."""

    scale: float | None = None
    softcap: float = 0.0
    window: int = 0


def test_a_layer_passes_its_own_parameters_to_attend():
    """attend(..., params) overrides the backend's; scale None means head_dim ** -0.5."""
    batch, kv, q = random_step([0, 37], [20, 1], 4, 2, 16, 8, seed=3)
    backend = TritonPagedBackend(8, DEVICE, 2)
    meta = backend.prepare(batch)
    want = reference(batch, kv, q, AttentionParams(16 ** -0.5, window=11, softcap=2.5))
    kv_d, q_d = kv.to(DEVICE), q.to(DEVICE)
    assert_close(backend.attend(kv_d, q_d, meta, LayerParams(window=11, softcap=2.5)).cpu(), want)
    assert_close(backend.attend(kv_d, q_d, meta).cpu(), reference(batch, kv, q, AttentionParams(16 ** -0.5)))


def test_half_precision_kv():
    """fp16 q and KV (the interpreter has no bf16 arithmetic; bf16 runs on the GPU tests):
    products in half precision, accumulation in fp32."""
    batch, kv, q = random_step([3, 50], [1, 18], 6, 2, 32, 16, seed=4)
    got = triton_attend(batch, kv.half(), q.half())
    assert got.dtype == torch.float16
    assert_close(got.float(), reference(batch, kv.half().float(), q.half().float(),
                                        AttentionParams(32 ** -0.5)), 3e-3)


def test_fp32_queries_over_a_f16_pool():
    """--kv-cache-dtype float16 under fp32 queries: the halves widened exactly, every dot in fp32
    (the fp32 tolerance against the reference over the rounded pool); under bf16 queries (a GPU
    forward), the dots in f16; the store kernel rounds new K/V into the f16 pool as torch's
    .half() does."""
    batch, kv, q = random_step([3, 50, 0], [1, 18, 5], 6, 2, 32, 16, seed=5)
    got = triton_attend(batch, kv.half(), q)
    assert got.dtype == torch.float32
    assert_close(got, reference(batch, kv.half().float(), q, AttentionParams(32 ** -0.5)))
    assert not torch.allclose(got.double(), reference(batch, kv, q, AttentionParams(32 ** -0.5)), atol=1e-6, rtol=0)
    # a GPU step's bf16 queries over an f16 pool: q rounded to f16 for the dots (bf16 -> f16 is
    # exact here), the output rounded to bf16 (the interpreter computes bf16 only through such casts)
    got = triton_attend(batch, kv.half(), q.bfloat16())
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), reference(batch, kv.half().float(), q.bfloat16().float(), AttentionParams(32 ** -0.5)),
                 1e-2)
    pool = torch.zeros(2, 6, 4, 2, 16, dtype=torch.float16)
    k, v = torch.randn(3, 2, 16) * 100, torch.randn(3, 2, 16) / 100
    store_kv(pool, k, v, torch.tensor([5, -1, 17]))
    assert torch.equal(pool[0].view(-1, 2, 16)[[5, 17]], k[[0, 2]].half())
    assert torch.equal(pool[1].view(-1, 2, 16)[[5, 17]], v[[0, 2]].half())


def test_store_kv_writes_slots_and_skips_padding_rows():
    kv = torch.randn(2, 6, 4, 2, 16)
    before = kv.clone()
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([9, -1, 22])
    stored = kv.to(DEVICE)
    store_kv(stored, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    flat = stored.cpu().view(2, -1, 2, 16)
    assert torch.equal(flat[0, 9], k[0]) and torch.equal(flat[1, 22], v[2])
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[[9, 22]] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 16)[:, untouched])


def test_padding_sequences_come_out_zero_and_real_rows_unchanged():
    batch, kv, q = random_step([5, 17], [1, 1], 6, 2, 32, 16, seed=5)
    padded = pad_layout(paged_layout(batch, 3), 4, 1)
    meta = PagedMetadata.upload(padded, torch.device(DEVICE))
    backend = TritonPagedBackend(16, DEVICE, 3, AttentionParams(32 ** -0.5))
    q_pad = torch.cat([q, torch.randn(2, 6, 32)])
    out = backend.attend(kv.to(DEVICE), q_pad.to(DEVICE), meta).cpu()
    assert torch.equal(out[:2], triton_attend(batch, kv, q))
    assert torch.equal(out[2:], torch.zeros(2, 6, 32))


@pytest.mark.parametrize("splits", [2, 4])
def test_keys_split_over_programs_give_the_reference(splits, monkeypatch):
    """Flash decoding: each program takes a share of a sequence's keys (some none at all: a
    short decode beside a long one), and a second launch merges their softmax states; with a
    tree, a window and soft-capping as in one launch."""
    from workers.model import triton_attention
    monkeypatch.setattr(triton_attention, "FORCED_SPLITS", splits)
    batch, kv, q = random_step([0, 15, 90, 9, 40], [1, 1, 4, 30, 1], 6, 2, 32, 16, seed=5)
    params = AttentionParams(32 ** -0.5)
    assert_close(triton_attend(batch, kv, q), reference(batch, kv, q, params))
    params = AttentionParams(0.3, window=20, softcap=5.0)
    assert_close(triton_attend(batch, kv, q, params), reference(batch, kv, q, params))
    parents = [-1, 0, 0, 1, 2]
    tree = TreeLayout()
    tree.add(verify_mask(seq=1, num_tokens=1 + len(parents), start=70, parents=parents))
    batch, kv, q = random_step([7, 70, 33], [1, 1 + len(parents), 2], 6, 2, 32, 16, seed=6, tree=tree)
    params = AttentionParams(32 ** -0.5)
    assert_close(triton_attend(batch, kv, q), reference(batch, kv, q, params))


def test_splits_are_for_steps_with_few_programs(monkeypatch):
    from workers.model import triton_attention
    monkeypatch.setattr(triton_attention, "FORCED_SPLITS", 0)
    monkeypatch.setattr(triton_attention, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert triton_attention.key_splits(1, 3, cuda) == 16  # SmolLM2 at batch 1: 3 programs
    assert triton_attention.key_splits(16, 3, cuda) == 4  # 48 programs: 5 per (tile, head), a power of two
    assert triton_attention.key_splits(64, 3, cuda) == 1  # 192 programs fill 132 SMs
    assert triton_attention.key_splits(1, 3, torch.device("cpu")) == 1
