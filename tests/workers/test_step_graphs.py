"""Graph steps' bookkeeping on CPU (workers/model/step_graphs.py): batch-size buckets, padding
a step to its bucket, the static buffers a graph reads, and - with a stand-in capture that
replays by calling the step again over the same static buffers - uniform steps (decodes,
verification trees) computed through the buffers equal the gathered torch path, in order."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.wire.protocol import StepPlan
from tests.workers.test_model_reference import BLOCK_SIZE, NUM_BLOCKS, Seqs
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import AttentionBatch, TorchPagedBackend
from workers.model.forward import DecoderModel
from workers.model.paged_layout import pad_layout, paged_layout
from workers.runner import ModelRunner
from workers.spec.tree import TreeLayout, verify_mask
from workers.weights.gguf_loader import load_weights

pytest.importorskip("triton")
from workers.model.paged_backend import TritonPagedBackend  # noqa: E402
from workers.model.step_graphs import (  # noqa: E402
    EagerCapture,
    StaticInputs,
    StepGraphs,
    batch_buckets,
    bucket_for,
)
from workers.model.triton_attention import AttentionParams, is_interpreted  # noqa: E402


def test_batch_buckets_cover_every_batch_size_up_to_max_seqs():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(5) == (1, 2, 4, 8)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert batch_buckets(300)[-4:] == (256, 272, 288, 304)
    buckets = batch_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 64, 65)] == [1, 4, 8, 16, 64, None]


def _batch(starts, rows, block_size=4, tree=None):
    starts, rows = np.asarray(starts), np.asarray(rows)
    blocks = -(-(starts + rows) // block_size)
    ids = np.random.default_rng(0).permutation(int(blocks.sum()) + 3)[:int(blocks.sum())]
    return AttentionBatch(starts, rows, blocks, ids, block_size, tree=tree)


def test_padding_a_step_adds_sequences_that_neither_write_nor_read():
    layout = paged_layout(_batch([5, 9, 2], [2, 2, 2]), group=3, block_m=16)
    padded = pad_layout(layout, 8, 2)
    assert padded.num_seqs == 8 and len(padded.slots) == 16 and padded.num_tiles == 8
    assert np.array_equal(padded.slots[:6], layout.slots) and np.all(padded.slots[6:] == -1)
    assert np.array_equal(padded.num_keys, [7, 11, 4, 0, 0, 0, 0, 0])
    assert np.array_equal(padded.first_rows, np.arange(8) * 2)
    assert np.array_equal(padded.tile_seqs, np.arange(8)) and not padded.tile_rows.any()
    with pytest.raises(ValueError, match="cannot pad"):
        pad_layout(paged_layout(_batch([5, 9], [1, 2]), 3, 16), 4, 1)


def test_static_inputs_show_the_last_step_loaded():
    inputs = StaticInputs(max_rows=16, max_seqs=8, max_tiles=8, table_width=6, tree_capacity=32,
                          device=torch.device("cpu"))
    big = pad_layout(paged_layout(_batch([5, 9, 2, 14, 0], [1] * 5), 3, 16), 8, 1)
    inputs.load(big, np.arange(5) + 100)
    small = pad_layout(paged_layout(_batch([3], [1]), 3, 16), 2, 1)
    inputs.load(small, np.array([7]))
    meta = inputs.metadata(small, has_tree=False)
    assert inputs.token_ids(2).tolist() == [7, 0]  # the big step's ids are gone from the rows read
    for name in ("slots", "num_keys", "first_rows", "tile_seqs", "positions"):
        assert getattr(meta, name).tolist() == getattr(small, name).tolist(), name
    assert meta.tables.shape == (2, 6) and meta.tables[0, :1].tolist() == small.tables[0].tolist()
    assert inputs.fits(small) and not inputs.fits(dataclasses.replace(small, tables=np.zeros((2, 7), np.int32)))


def test_a_step_sends_only_the_table_columns_its_sequences_reach():
    """The tables travel compact ([S, used width]) and are widened on the device: each
    sequence's blocks land in its row of the wide table, whatever the widest context."""
    inputs = StaticInputs(max_rows=16, max_seqs=8, max_tiles=8, table_width=512, tree_capacity=32,
                          device=torch.device("cpu"))
    layout = pad_layout(paged_layout(_batch([5, 9, 2, 14, 0], [1] * 5), 3, 16), 8, 1)
    assert layout.tables.shape == (8, 4)
    inputs.load(layout, np.arange(5))
    assert inputs.bytes_sent < inputs.offsets["compact_tables"] * 4 + 8 * 4 * 4 + 1  # not 8 x 512
    meta = inputs.metadata(layout, has_tree=False)
    assert meta.tables.shape == (8, 512)
    assert np.array_equal(meta.tables[:, :4].numpy(), layout.tables)


class CountingCapture(EagerCapture):
    """The CPU stand-in for CUDA graphs: a replay calls the captured step again."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, fn):
        step = super().capture(fn)

        def replay():
            self.replays += 1
            return step()
        return replay


@pytest.fixture(scope="module")
def model(tiny_gguf):
    path = tiny_gguf(layers=1, hidden=64, heads=4, kv_heads=2, ffn=64, vocab=320)
    return DecoderModel(load_weights(GGUFFile(path), progress=False))


def _runners(model, capture):
    p = model.params
    shape = PoolShape(p.num_layers, NUM_BLOCKS, BLOCK_SIZE, p.num_kv_heads, p.head_dim)
    reference = ModelRunner(model, KVPool.create(shape), TorchPagedBackend(BLOCK_SIZE, chunk_bytes=None))
    pool = KVPool.create(shape)
    backend = TritonPagedBackend(BLOCK_SIZE, "cpu", p.num_heads // p.num_kv_heads,
                                 AttentionParams(p.head_dim ** -0.5))
    graphs = StepGraphs(model, [pool.layer(0)], backend, capture, buckets=(2, 4), rows_per_seq=(1, 3),
                        max_blocks_per_seq=16)
    with torch.inference_mode():
        graphs.capture_all()
    return reference, ModelRunner(model, pool, backend, graphs=graphs)


def _logits(runner, step_id, chunks, new=(), tree=None):
    plan = StepPlan.build(step_id, chunks, list(new))
    plan = dataclasses.replace(plan, num_draft_tokens=(plan.num_tokens - 1).astype(np.int32))
    return runner.forward_logits(plan, tree)


@pytest.mark.slow  # ~10 s: four forwards of a 1-layer model per capture and step, interpreted
@pytest.mark.skipif(not is_interpreted(), reason="needs Triton's interpreter (tests/conftest.py)")
def test_uniform_steps_through_the_static_buffers_equal_the_gathered_path(model):
    capture = CountingCapture()
    reference, graphed = _runners(model, capture)
    assert {(k.num_seqs, k.rows_per_seq) for k in graphed.graphs.graphs} == {(2, 1), (4, 1), (2, 3), (4, 3)}
    seqs = Seqs({"a": 19, "b": 7, "c": 12}, model.params.vocab_size, seed=4)
    prompts = {"a": 9, "b": 3, "c": 6}
    steps = [([seqs.chunk(r, 0, n) for r, n in prompts.items()], [seqs.new(r) for r in prompts], None)]
    for step in range(2):  # decodes: 3 sequences in the bucket of 4
        steps.append(([seqs.chunk(r, n + step, 1) for r, n in prompts.items()], [], None))
    tree = TreeLayout()  # verification: 2 sequences x (root + 2 drafts), one a tree
    tree.add(verify_mask(seq=0, num_tokens=3, start=11, parents=[-1, -1]))
    steps.append(([seqs.chunk("a", 11, 3), seqs.chunk("c", 8, 3)], [], tree))
    replays = []
    for step_id, (chunks, new, step_tree) in enumerate(steps):
        want = _logits(reference, step_id, chunks, new, step_tree)
        got = _logits(graphed, step_id, chunks, new, step_tree)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        replays.append(capture.replays)
    assert replays == [0, 1, 2, 3]  # the prefill ran eagerly, the uniform steps from graphs


@pytest.mark.slow  # ~10 s: 1-layer forwards of up to 48 rows, interpreted
@pytest.mark.skipif(not is_interpreted(), reason="needs Triton's interpreter (tests/conftest.py)")
def test_mixed_steps_replay_the_graph_of_their_token_count(model):
    """Prefills, prompt chunks beside decodes and a lone prompt through the graphs of 32 and 48
    rows (padded with a keyless sequence, idle tiles, the sampled rows gathered) equal the
    gathered path; a step past the largest bucket runs eagerly."""
    from workers.model.mixed_graphs import MixedGraphs, token_buckets

    assert token_buckets(40) == (32, 48) and token_buckets(2048)[-3:] == (1024, 1536, 2048)
    capture = CountingCapture()
    reference, graphed = _runners(model, capture)
    graphs = graphed.graphs
    graphs.mixed = MixedGraphs(model, graphs.kv_layers, graphs.backend, capture, 40, 4, 16, graphs.logits)
    with torch.inference_mode():
        graphs.mixed.capture_all()
    assert graphs.mixed.sizes == (32, 48)
    seqs = Seqs({"a": 12, "b": 5, "c": 14, "d": 20, "e": 45, "f": 60}, model.params.vocab_size, seed=5)
    steps = [([seqs.chunk("a", 0, 9), seqs.chunk("b", 0, 3), seqs.chunk("c", 0, 6)],  # 18 rows: 32
              [seqs.new(r) for r in "abc"]),
             ([seqs.chunk("a", 9, 1), seqs.chunk("b", 3, 1), seqs.chunk("c", 6, 8), seqs.chunk("d", 0, 20)],
              [seqs.new("d")]),  # decodes beside a chunk and a new prompt: 30 rows
             ([seqs.chunk("e", 0, 45)], [seqs.new("e")]),  # 48
             ([seqs.chunk("f", 0, 60)], [seqs.new("f")])]  # past 48: eager
    replays = []
    for step_id, (chunks, new) in enumerate(steps):
        plan = StepPlan.build(step_id, chunks, list(new))
        want = reference.forward_logits(plan)
        got = graphed.forward_logits(plan)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        replays.append(capture.replays)
    assert replays == [1, 2, 3, 3]


def test_padding_a_mixed_step_keeps_the_real_rows_and_adds_a_keyless_sequence():
    from workers.model.paged_layout import pad_mixed_layout

    layout = paged_layout(_batch([0, 9, 2], [7, 1, 2]), group=2, block_m=16)  # block_q 8
    padded = pad_mixed_layout(layout, 5, 32, 12)
    assert len(padded.slots) == 32 and np.all(padded.slots[10:] == -1)
    assert np.array_equal(padded.slots[:10], layout.slots)
    assert np.array_equal(padded.num_rows, [7, 1, 2, 22, 0]) and np.array_equal(padded.num_keys[3:], [0, 0])
    assert padded.first_rows.tolist()[3:] == [10, 10] and padded.num_tiles == 12
    assert padded.tile_seqs.tolist()[3:] == [3] * 9  # 3 tiles cover its 22 rows, 6 idle past them
    assert padded.tile_rows.tolist()[3:] == [0, 8, 16] + [24] * 6
    with pytest.raises(ValueError, match="does not fit"):
        pad_mixed_layout(layout, 5, 32, 5)


def test_layout_tables_equal_the_batch_padded_tables():
    batch = _batch([5, 0, 30, 3], [1, 7, 2, 1], block_size=4)
    tables = paged_layout(batch, 2, 16).tables
    assert np.array_equal(tables, batch.padded_tables(np.arange(4)))
