"""A CPU decode step's layers as one C call (workers/model/cpu_layer_chain.py): on each matmul
path it takes (int8, int8 panels) and for several block types, steps of decode and
verification rows (1-3 a sequence) give the hidden states of the Python layer loop bit for bit,
and the same greedy tokens; steps it does not cover (prefill, dense tiles) run the loop; models it does not cover
have no chain; a bad slot is a ValueError that writes nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from workers.kv.pool import KVPool, PoolShape
from workers.model import cpu_layer_chain
from workers.model.attention import TorchCpuBackend
from workers.runner import ModelRunner
from workers.weights.block_kernels import block_kernels
from workers.weights.path_plan import PathPlan
from workers.weights.paths import load_model
from tests.support.hf_gguf import tiny_hf_model, write_gguf

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="no C compiler: no block kernels")
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPTS = {"a": list(range(3, 23)), "b": list(range(40, 73)), "c": list(range(100, 107))}


def load(path: str, plan: PathPlan, chain: bool, kv_dtype: torch.dtype = torch.float32):
    model = load_model(GGUFFile(path), weights="auto", progress=False, plan=plan)
    if not chain:
        model.layer_chain = None
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, 64, 16, p.num_kv_heads, p.head_dim), dtype=kv_dtype)
    return model, pool, ModelRunner(model, pool, TorchCpuBackend(16))


def decode(model, runner, steps: int, vocab: int = 384) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill the three prompts, then `steps` steps of 1-3 rows per sequence (decode, and rows
    as speculative verification sends them, ragged): (each step's forward output, each step's
    sampled tokens)."""
    hidden: list[torch.Tensor] = []
    forward = model.forward
    model.forward = lambda *args: (hidden.append(forward(*args).clone()), hidden[-1])[1]
    tables = {rid: list(range(4 * i, 4 * i + 4)) for i, rid in enumerate(PROMPTS)}
    new = [NewRequest(rid, GREEDY, len(p), np.asarray(p, np.int32)) for rid, p in PROMPTS.items()]
    out = runner.execute(StepPlan.build(0, [(rid, 0, p, tables[rid], True) for rid, p in PROMPTS.items()], new))
    tokens = [[int(t) for t in out.sampled_token_ids]]
    lengths = {rid: len(p) for rid, p in PROMPTS.items()}
    for step in range(steps):
        chunks = []
        for i, rid in enumerate(PROMPTS):
            rows = [tokens[-1][i]] + [(7 * step + j) % (vocab - 3) + 3 for j in range(step * (i + 1) % 3)]
            chunks.append((rid, lengths[rid], rows, tables[rid], True))
            lengths[rid] += len(rows)
        tokens.append([int(t) for t in runner.execute(StepPlan.build(1 + step, chunks)).sampled_token_ids])
    model.forward = forward
    return hidden, tokens


def count_runs(monkeypatch) -> list[int]:
    """The rows of every step the chain runs, from now on."""
    runs: list[int] = []
    real_run = cpu_layer_chain.LayerChain.run
    monkeypatch.setattr(cpu_layer_chain.LayerChain, "run",
                        lambda self, *args: (runs.append(args[0].shape[0]), real_run(self, *args))[1])
    return runs


CASES = [("Q4_1", "int8", 64), ("Q8_0", "int8", 64), ("Q4_0", "int8_panels", 64), ("Q5_1", "int8", 64),
         ("Q4_K", "int8", 256), ("Q6_K", "int8_panels", 256)]


@pytest.mark.parametrize("qtype,path,hidden", CASES, ids=[f"{t}-{p}" for t, p, _ in CASES])
def test_decode_steps_give_the_loops_bits(tiny_gguf, monkeypatch, qtype, path, hidden):
    if path == "int8_panels" and not block_kernels().has_panels:
        pytest.skip("the int8 panels need AVX2")
    gguf = tiny_gguf(layers=2, hidden=hidden, heads=4, kv_heads=2, ffn=hidden * 2, vocab=384, context=256,
                     type=qtype, embed_type="Q8_0")
    plan = PathPlan(((8, path), (1 << 16, "dense")))  # prefill (60 rows): dense tiles, the loop
    runs = count_runs(monkeypatch)
    results = {}
    for chain in (True, False):
        model, pool, runner = load(gguf, plan, chain)
        assert (model.layer_chain is not None) == chain
        results[chain] = decode(model, runner, steps=5)
        pool.close()
    assert runs == [3, 6, 6, 3, 6]  # every step of short chunks, no prefill
    (hidden_chain, tokens_chain), (hidden_loop, tokens_loop) = results[True], results[False]
    assert tokens_chain == tokens_loop
    assert len(hidden_chain) == len(hidden_loop) == 6
    for got, want in zip(hidden_chain, hidden_loop):
        assert torch.equal(got, want)


def test_a_matrix_stacked_from_two_types_runs_in_the_chain_part_by_part(tiny_gguf, monkeypatch):
    """A Q4_K_M file's attention: q and k Q4_K, v Q6_K, so qkv is a stack of parts (and ffn_down
    Q6_K). The chain computes each part into its columns, as the loop's StackLinear does: the
    same bits, with the chain taking every decode step (1 and 2 rows: the direct path, 3 and 6:
    the coded tiles)."""
    gguf = tiny_gguf(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=384, context=256, type="Q4_K",
                     v_type="Q6_K", embed_type="Q8_0")
    plan = PathPlan(((8, "int8"), (1 << 16, "dense")))
    runs = count_runs(monkeypatch)
    results = {}
    for chain in (True, False):
        model, pool, runner = load(gguf, plan, chain)
        assert len(model.layers[0].qkv.parts) == 3  # q, k (Q4_K) and v (Q6_K), each its own part
        assert (model.layer_chain is not None) == chain
        results[chain] = decode(model, runner, steps=5)
        pool.close()
    assert runs == [3, 6, 6, 3, 6]
    assert results[True][1] == results[False][1]
    assert all(torch.equal(a, b) for a, b in zip(results[True][0], results[False][0]))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_over_a_16_bit_pool_the_chain_gives_the_loops_bits(tiny_gguf, monkeypatch, half):
    """--kv-cache-dtype bfloat16 / float16: the chain stores and attends through that pool's
    kernels, as the loop's KV store and attention do."""
    gguf = tiny_gguf(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=384, context=256, type="Q4_1",
                     embed_type="Q8_0")
    plan = PathPlan(((8, "int8"), (1 << 16, "dense")))
    runs = count_runs(monkeypatch)
    results = {}
    for chain, dtype in ((True, half), (False, half), (True, torch.float32)):
        model, pool, runner = load(gguf, plan, chain, dtype)
        results[chain, dtype] = decode(model, runner, steps=5)
        assert pool.tensor.dtype == dtype and pool.tensor[:, :, :12].abs().sum() > 0  # K/V were stored
        pool.close()
    assert runs == [3, 6, 6, 3, 6] * 2
    hidden_chain, tokens_chain = results[True, half]
    hidden_loop, tokens_loop = results[False, half]
    assert tokens_chain == tokens_loop
    for got, want in zip(hidden_chain, hidden_loop):
        assert torch.equal(got, want)
    hidden_fp32 = results[True, torch.float32][0]
    assert not torch.equal(hidden_fp32[1], hidden_chain[1])  # attention read the rounded pool
    torch.testing.assert_close(hidden_fp32[-1], hidden_chain[-1], atol=0.05, rtol=0.05)


def test_qkv_biases_in_the_chain_give_the_loops_bits(tmp_path):
    """Qwen2's layers add a bias to QKV: the chain adds it after the matmul, one add a value, as
    the loop's `qkv + bias` does."""
    gguf = write_gguf(tiny_hf_model("qwen2"), str(tmp_path / "qwen2.gguf"), "Q8_0")
    results = {}
    for chain in (True, False):
        model, pool, runner = load(gguf, PathPlan(((8, "int8"), (1 << 16, "dense"))), chain)
        assert (model.layer_chain is not None) == chain and model.layers[0].qkv_bias is not None
        results[chain] = decode(model, runner, steps=4, vocab=model.params.vocab_size)
        pool.close()
    assert results[True][1] == results[False][1]
    assert all(torch.equal(a, b) for a, b in zip(results[True][0], results[False][0]))


def test_steps_and_models_it_does_not_cover(tiny_gguf, monkeypatch):
    gguf = tiny_gguf(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=384, context=256, type="Q4_1",
                     embed_type="Q8_0")
    runs = count_runs(monkeypatch)
    model, pool, runner = load(gguf, PathPlan(((2, "int8"), (1 << 16, "dense"))), chain=True)
    new = [NewRequest("a", GREEDY, 8, np.arange(3, 11, dtype=np.int32))]
    runner.execute(StepPlan.build(0, [("a", 0, list(range(3, 11)), [0, 1], True)], new))
    runner.execute(StepPlan.build(1, [("a", 8, [5, 6], [0, 1], True)]))  # two rows of one sequence
    assert runs == [2]
    new = [NewRequest(r, GREEDY, 4, np.arange(3, 7, dtype=np.int32)) for r in "bcd"]
    runner.execute(StepPlan.build(2, [(r, 0, [3, 4, 5, 6], [4 + i], True) for i, r in enumerate("bcd")], new))
    assert runs == [2]  # a prefill
    runner.execute(StepPlan.build(3, [(r, 4, [7], [4 + i], True) for i, r in enumerate("bcd")]))  # 3 rows: dense
    assert runs == [2]
    runner.execute(StepPlan.build(4, [("a", 10, [7], [0, 1], True)]))
    assert runs == [2, 1]
    pool.close()
    assert load_model(GGUFFile(gguf), weights="fp32", progress=False).layer_chain is None
    monkeypatch.setenv(cpu_layer_chain.ENABLE_ENV, "0")
    assert load_model(GGUFFile(gguf), weights="auto", progress=False,
                      plan=PathPlan.only("int8")).layer_chain is None


def _bad_slots(meta):
    meta.slots = torch.full_like(meta.slots, 64 * 16)  # one past the pool's last slot


def _bad_rows(meta):
    meta.short.rows = torch.full_like(meta.short.rows, 1)  # a decode step has row 0 only


@pytest.mark.parametrize("corrupt,error", [(_bad_slots, "KV slot is outside the pool"),
                                           (_bad_rows, "row map is outside the step's rows")],
                         ids=["slot", "row-map"])
def test_a_bad_slot_or_row_map_is_a_value_error_and_writes_nothing(tiny_gguf, monkeypatch, corrupt, error):
    """The chain checks its KV slots and its row maps (padded query rows -> step rows) before
    any layer runs."""
    gguf = tiny_gguf(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=384, context=256, type="Q4_1",
                     embed_type="Q8_0")
    model, pool, runner = load(gguf, PathPlan.only("int8"), chain=True)
    new = [NewRequest("a", GREEDY, 8, np.arange(3, 11, dtype=np.int32))]
    runner.execute(StepPlan.build(0, [("a", 0, list(range(3, 11)), [0], True)], new))
    layers = [pool.layer(i) for i in range(pool.shape.num_layers)]
    before = [layer.clone() for layer in layers]
    prepare = runner.backend.prepare

    def corrupted(batch):
        meta = prepare(batch)
        corrupt(meta)
        return meta
    monkeypatch.setattr(runner.backend, "prepare", corrupted)
    with pytest.raises(ValueError, match=error):
        runner.execute(StepPlan.build(1, [("a", 8, [5], [0], True)]))
    assert all(torch.equal(layer, old) for layer, old in zip(layers, before))
    pool.close()



def test_packed_blocks_give_the_steps_of_the_files_layout(tiny_gguf, monkeypatch):
    """Under auto, Q4_K and Q6_K matrices are packed at load (rows interleaved by 8), the tied
    embedding included, whose lookups then read the head's packed copy: prefill (dense tiles
    read back) and decode steps (the chain, on the packed kernel) give the bits of the same
    model kept in the file's layout (JUSTAPI_PACK_BLOCKS=0)."""
    if not block_kernels().has_packed:
        pytest.skip("the packed layout needs AVX2 and F16C")
    gguf = tiny_gguf(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=384, context=256, type="Q4_K",
                     v_type="Q6_K", embed_type="Q6_K")
    plan = PathPlan(((8, "int8"), (1 << 16, "dense")))
    results = {}
    for packed in (True, False):
        monkeypatch.setenv("JUSTAPI_PACK_BLOCKS", "1" if packed else "0")
        model, pool, runner = load(gguf, plan, chain=True)
        assert model.layer_chain is not None
        assert model.layers[0].ffn.gate_up.matrix.packed == packed
        assert model.output.matrix.packed == packed and model.token_embd is model.output.matrix  # tied
        results[packed] = decode(model, runner, steps=3)
        pool.close()
    assert results[True][1] == results[False][1]
    assert all(torch.equal(a, b) for a, b in zip(results[True][0], results[False][0]))
