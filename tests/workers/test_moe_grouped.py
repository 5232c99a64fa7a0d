"""MoE experts as grouped matmuls (workers/model/moe_grouped.py), in Triton's CPU interpreter
here and compiled on a GPU: the routed result equals the per-expert loop's (dense experts and
GGUF blocks, renormalized or not, a shared expert), the tile layout holds each entry once in
its expert's tiles, and the path reads nothing back to the host (on a CPU: no tensor turned
into a Python value; on a GPU: torch's sync debug mode, and a CUDA graph of it replays)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from workers.weights.gguf_loader import ExpertWeights
from workers.weights.kquant_pack import quantize

pytest.importorskip("triton")
from workers.model import moe_grouped  # noqa: E402
from workers.model.ffn import MoeFfn  # noqa: E402
from workers.model.forward import Linear  # noqa: E402
from workers.model.triton_attention import is_interpreted  # noqa: E402
from workers.weights.block_matrix import BlockMatrix  # noqa: E402

DEVICE = os.environ.get("JUSTAPI_TEST_GPU_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not is_interpreted(),
                                reason="needs a GPU or Triton's interpreter (tests/conftest.py)")
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
HIDDEN, FFN, NUM_EXPERTS = 256, 64, 6


Q = GGMLQuantizationType
BLOCKS = (Q.Q4_K, Q.Q8_0)
"""gate/up and down types of the experts kept as blocks (down's 64 inputs are no K-quant row)."""


def expert_weights(seed: int, qtypes: tuple | None, shared: bool) -> ExpertWeights:
    """Random experts, dense or as GGUF blocks of `qtypes` (gate/up, down), on DEVICE."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int):
        qtype = None if qtypes is None else qtypes[cols != HIDDEN]
        values = torch.randn(rows, cols, generator=gen) / cols ** 0.5
        if qtype is None:
            return values.to(DEVICE, DTYPE)
        raw = np.ascontiguousarray(quantize(values.numpy(), qtype)).reshape(rows, -1)
        return BlockMatrix(torch.from_numpy(raw.copy()), qtype, cols).to(DEVICE, DTYPE)

    weights = ExpertWeights(router=torch.randn(NUM_EXPERTS, HIDDEN, generator=gen).to(DEVICE, DTYPE),
                            gate_up=[matrix(2 * FFN, HIDDEN) for _ in range(NUM_EXPERTS)],
                            down=[matrix(HIDDEN, FFN) for _ in range(NUM_EXPERTS)])
    if shared:
        weights.shared_gate_up, weights.shared_down = matrix(2 * FFN, HIDDEN), matrix(HIDDEN, FFN)
        weights.shared_gate = torch.randn(HIDDEN, generator=gen).to(DEVICE, DTYPE)
    return weights


def both(weights: ExpertWeights, num_used: int, renormalize: bool) -> tuple[MoeFfn, MoeFfn]:
    def dense(m):
        return Linear(m if isinstance(m, torch.Tensor) else m.dense().to(DEVICE, DTYPE))
    return (MoeFfn(weights, dense, num_used, renormalize, grouped=False),
            MoeFfn(weights, dense, num_used, renormalize, grouped=True))


@pytest.mark.parametrize("qtypes,num_used,renormalize,shared", [
    (None, 2, True, False), (BLOCKS, 2, False, True), (None, 3, True, False)],
    ids=["dense", "blocks-shared", "dense-top3"])
def test_grouped_experts_equal_the_per_expert_loop(qtypes, num_used, renormalize, shared):
    looped, grouped = both(expert_weights(1, qtypes, shared), num_used, renormalize)
    assert grouped.stacks is not None and looped.stacks is None
    stack_types = [stack.qtype for stack in grouped.stacks]
    assert stack_types == ([None, None] if qtypes is None else list(qtypes))  # blocks stay blocks
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    with torch.inference_mode():
        want, got = looped(x).float(), grouped(x).float()
        assert len(torch.unique(looped.route(x)[0])) > num_used  # the rows chose different experts
        again = grouped(x).float()
    tolerance = 1e-5 if DTYPE == torch.float32 else 3e-2
    assert float((got - want).abs().max()) <= tolerance * float(want.abs().max())
    assert torch.equal(got, again)  # the same bits every run
    one = grouped(x[:1]).float()  # a lone decode row: most tiles are padding
    assert float((one - want[:1]).abs().max()) <= tolerance * float(want.abs().max())


def test_the_layout_puts_each_entry_once_in_its_experts_tiles():
    experts = torch.tensor([[2, 0], [2, 5], [0, 2], [3, 2]], device=DEVICE)
    layout = moe_grouped.grouped_layout(experts, NUM_EXPERTS)
    bm = moe_grouped.BLOCK_M
    entry_ids, tile_experts = layout.entry_ids.cpu(), layout.tile_experts.cpu()
    assert len(entry_ids) == len(tile_experts) * bm and len(entry_ids) >= 8 + NUM_EXPERTS * (bm - 1)
    assert sorted(entry_ids[entry_ids >= 0].tolist()) == list(range(8))
    flat = experts.reshape(-1).cpu()
    for tile, expert in enumerate(tile_experts.tolist()):
        members = entry_ids[tile * bm:(tile + 1) * bm]
        members = members[members >= 0]
        assert expert >= 0 or not len(members)  # an unused tile holds no entry
        assert all(int(flat[e]) == expert for e in members)
    assert tile_experts.tolist()[:3] == [0, 2, 3] and set(tile_experts.tolist()[4:]) == {-1}
    assert entry_ids[bm:bm + 4].tolist() == [0, 2, 5, 7]  # expert 2's entries, in row order


class HostRead(Exception):
    pass


def test_the_grouped_path_reads_nothing_back_to_the_host(monkeypatch):
    """On a GPU under torch's sync debug mode; on a CPU, with every way a tensor becomes a
    Python value raising (the kernel is stood in for: the interpreter itself reads tensors)."""
    _, grouped = both(expert_weights(3, BLOCKS, True), 2, True)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPE)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                grouped(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    looped = MoeFfn(expert_weights(3, None, False), Linear, 2, True, grouped=False)
    monkeypatch.setattr(moe_grouped.ExpertStack, "matmul", lambda self, x, layout, row_div: torch.zeros(
        layout.num_entries, self.out_features, dtype=x.dtype))

    def refuse(*args, **kwargs):
        raise HostRead("a tensor was read on the host")
    for name in ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with torch.inference_mode():
        grouped(x)
    with pytest.raises(HostRead), torch.inference_mode():
        looped(x)  # the per-expert loop reads its counts: the guard sees it


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs")
def test_a_moe_layer_is_captured_in_a_cuda_graph():
    _, grouped = both(expert_weights(5, BLOCKS, False), 2, True)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(6)).to(DEVICE, DTYPE)
    with torch.inference_mode():
        want = grouped(x).clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            grouped(x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = grouped(x)
        x.copy_(x.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, grouped(x))  # the replay computed the new inputs
        assert torch.allclose(out.flip(0).float(), want.float(), rtol=2e-2, atol=2e-2)
