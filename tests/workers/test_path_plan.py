"""`--weights auto`'s per-step choice (path_plan.py, block_linear.py, paths.py): the fitted lines
and the plan they give, the cache, measurement on a fake clock, the paths of a BlockLinear
against the dense product, and a model loaded under auto keeping every quantized matrix as
the file's blocks (its tensors checked, not RSS) and computing what fp32 computes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from justapi.model.gguf_file import GGUFFile
from workers.model.forward import Linear
from workers.weights.block_kernels import block_kernels
from workers.weights.block_linear import BlockLinear, StackLinear, TileScratch
from workers.weights.block_matrix import BlockMatrix, RowStack, block_matrix
from workers.weights.kquant_pack import quantize
from workers.weights.path_plan import PathPlan, PlanCache, fit_line, measure_plan, plan_from_timings
from workers.weights.paths import load_model

Q = GGMLQuantizationType
needs_kernels = pytest.mark.skipif(block_kernels() is None, reason="no C compiler: block kernels unavailable")


def test_fit_line_recovers_a_line_and_clamps_negative_parts():
    rows = [1, 2, 4, 8, 16]
    assert fit_line(rows, [3 + 0.5 * r for r in rows]) == pytest.approx((3.0, 0.5))
    assert fit_line(rows, [5.0 - 0.1 * r for r in rows])[1] == 0.0  # never cheaper with more rows
    assert fit_line([1, 2], [1.0, 1.0]) == pytest.approx((1.0, 0.0))


def test_plan_from_timings_splits_rows_where_the_lines_cross():
    rows = [1, 2, 4, 8, 16, 32, 64]
    seconds = {"int8": [1 + 0.5 * r for r in rows], "blocks": [2 + 0.45 * r for r in rows],
               "dense": [10 + 0.2 * r for r in rows]}
    # int8 < blocks until 1 + 0.5 r = 2 + 0.45 r (r = 20); blocks < dense until r = 32
    plan = plan_from_timings(rows, seconds)
    assert plan.steps == ((20, "int8"), (32, "blocks"), (1 << 16, "dense"))
    assert [plan.path_for(r) for r in (1, 20, 21, 32, 33, 4096, 10**6)] == \
        ["int8", "int8", "blocks", "blocks", "dense", "dense", "dense"]
    noisy = {p: list(t) for p, t in seconds.items()}
    noisy["dense"][2] = 0.1  # one wild median moves the fit, it does not carve out a range
    assert len(plan_from_timings(rows, noisy).steps) <= 3
    assert plan_from_timings(rows, {"dense": seconds["dense"]}).steps == ((1 << 16, "dense"),)
    with pytest.raises(ValueError, match="one time per measured row count"):
        plan_from_timings(rows, {"int8": [1.0] * 8})
    assert plan_from_timings(rows, {"int8": [1.0, 1.5], "dense": seconds["dense"]}).path_for(1) == "int8"


def test_a_path_measurement_stopped_timing_does_not_take_larger_counts():
    """blocks was timed at 1-4 rows only (far behind there): its flat fitted line lies below
    the others past 512 rows, but it was never measured there, so it takes nothing."""
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 512]
    seconds = {"int8": [2 + 0.5 * r for r in rows], "int8_panels": [4 + 0.2 * r for r in rows],
               "blocks": [20.0, 20.5, 21.0]}
    plan = plan_from_timings(rows, seconds)
    assert {path for _, path in plan.steps} == {"int8", "int8_panels"}
    assert plan.path_for(10**5) == "int8_panels" and plan.path_for(1) == "int8"
    # where every path stopped early (not from measure_plan), the plan still names one
    assert plan_from_timings(rows, {"blocks": [20.0, 20.5, 21.0]}).path_for(10**5) == "blocks"


def test_path_plan_validates_and_describes():
    assert PathPlan(((4, "int8"), (8, "dense"))).describe() == "int8 <= 4 rows < dense"
    assert PathPlan.only("blocks").path_for(10**6) == "blocks"
    with pytest.raises(ValueError, match="must rise"):
        PathPlan(((8, "int8"), (4, "dense")))
    with pytest.raises(ValueError, match="unknown weight paths"):
        PathPlan(((4, "int4"),))


def test_plan_cache_round_trip_and_bad_files(tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    key = PlanCache.key("cpu A", "src", "Q4_K", (64, 256), ("int8", "dense"))
    assert key != PlanCache.key("cpu B", "src", "Q4_K", (64, 256), ("int8", "dense"))
    assert cache.get(key) is None
    plan = PathPlan(((12, "int8"), (1 << 16, "dense")))
    cache.put(key, plan)
    cache.put("other", PathPlan.only("dense"))
    assert PlanCache(tmp_path / "plans.json").get(key) == plan
    (tmp_path / "plans.json").write_text('{"k": [[1, "nonsense"]]')
    assert cache.get("k") is None and cache.get(key) is None  # corrupt: measured again


def test_measure_plan_on_a_fake_clock():
    clock = [0.0]
    cost = {"int8": (1.0, 0.5), "dense": (10.5, 0.2)}  # seconds: a + b * rows; equal at 31.7

    def run(path: str, x: torch.Tensor) -> None:
        a, b = cost[path]
        clock[0] += a + b * x.shape[0]

    plan, seconds = measure_plan(run, 8, ["int8", "dense"], rows=(1, 4, 16, 64), repeats=3,
                                 timer=lambda: clock[0])
    assert seconds["dense"] == pytest.approx([10.7, 11.3, 13.7, 23.3])
    assert plan.steps == ((31, "int8"), (1 << 16, "dense"))
    cost["blocks"] = (40.0, 1.0)  # 2x behind at every count: timed at the first three only
    plan, seconds = measure_plan(run, 8, ["int8", "dense", "blocks"], rows=(1, 4, 16, 64), repeats=3,
                                 timer=lambda: clock[0])
    assert len(seconds["blocks"]) == 3 and len(seconds["dense"]) == 4
    assert plan.steps == ((31, "int8"), (1 << 16, "dense"))


def test_a_path_behind_at_few_rows_but_catching_up_is_timed_on():
    """The int8 panels compute 8 rows as cheaply as 1: far behind the per-row kernel at 1-4
    rows of a wide matrix, ahead from a few dozen. Dropping them for being 2x behind early
    sent a 7B model's prefill chunks to a slower path."""
    clock = [0.0]
    cost = {"int8": (1.0, 0.5), "int8_panels": (30.0, 0.1), "blocks": (40.0, 1.0)}

    def run(path: str, x: torch.Tensor) -> None:
        a, b = cost[path]
        clock[0] += a + b * x.shape[0]

    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    plan, seconds = measure_plan(run, 8, list(cost), rows=rows, repeats=3, timer=lambda: clock[0])
    assert len(seconds["int8_panels"]) == len(rows)  # 20x behind at first, but catching up
    assert len(seconds["blocks"]) == 3  # behind and falling further behind
    assert plan.path_for(8) == "int8" and plan.path_for(128) == "int8_panels"
    assert plan.steps[0] == (72, "int8")  # 1 + 0.5 r = 30 + 0.1 r at r = 72.5


def blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> BlockMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return block_matrix(quantize(w, qtype), qtype, (rows, cols))


@needs_kernels
@pytest.mark.parametrize("dtype_path", ["dense", "blocks", "int8"])
def test_block_linear_paths_equal_the_dense_product(dtype_path):
    matrix = blocks(Q.Q6_K, 72, 512)
    scratch = TileScratch(max_bytes=16 * 512 * 4)  # 16 rows a tile: 5 tiles, the last partial
    linear = BlockLinear(matrix, block_kernels(), PathPlan.only(dtype_path), scratch)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    reference = x.double() @ matrix.dense().double().T
    tolerance = 2e-2 if dtype_path == "int8" else 1e-4  # int8: x rounded to 8 bits per 32 values
    error = (linear(x).double() - reference).abs().max() / reference.abs().max()
    assert error < tolerance and linear.num_calls[dtype_path] == 1
    assert scratch.buffer.numel() <= 16 * 512 * 4  # never more than one tile


@needs_kernels
def test_block_linear_follows_its_plan_and_warm_up_sizes_the_scratch():
    matrix = blocks(Q.Q4_K, 40, 256)
    scratch = TileScratch()
    linear = BlockLinear(matrix, block_kernels(), PathPlan(((4, "int8"), (1 << 16, "dense"))), scratch)
    linear.warm_up(max_rows=64)
    assert scratch.buffer.numel() == 40 * 256 * 4  # the whole matrix is one tile
    for rows in (1, 4, 5, 64):
        linear(torch.randn(rows, 256))
    assert (linear.num_calls["int8"], linear.num_calls["dense"]) == (2, 2)
    with pytest.raises(ValueError, match="unknown weight path 'int4'"):
        linear.run("int4", torch.randn(1, 256))


@needs_kernels
def test_stack_linear_puts_the_parts_side_by_side():
    parts = [blocks(Q.Q4_K, 16, 256, 1), blocks(Q.Q6_K, 8, 256, 2)]
    plan = PathPlan.only("dense")
    scratch = TileScratch()
    stack = StackLinear([BlockLinear(p, block_kernels(), plan, scratch) for p in parts] + [Linear(torch.ones(3, 256))])
    x = torch.randn(5, 256)
    expected = x @ RowStack((*parts, torch.ones(3, 256))).dense().T
    assert stack.out_features == 27 and torch.allclose(stack(x), expected, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q3_K", "IQ4_XS", "IQ4_NL"])
def test_auto_keeps_every_quantized_matrix_as_the_files_blocks(tiny_gguf, type_name):
    """K-quant (and IQ4_XS) rows are 256-value blocks: the tiny model's dims are 256."""
    path = tiny_gguf(type=type_name, embed_type="Q8_0", hidden=256, heads=4, kv_heads=2, ffn=256, layers=2)
    model = load_model(GGUFFile(path), weights="auto", progress=False, plan=PathPlan.only("blocks"))
    linears = [lin for layer in model.layers for lin in layer.linears()]
    assert all(isinstance(lin, BlockLinear) and lin.matrix.type_name == type_name for lin in linears)
    assert isinstance(model.token_embd, BlockMatrix) and model.output.matrix is model.token_embd  # tied
    gguf = GGUFFile(path)
    file_bytes = sum(int(t.n_bytes) for t in gguf.reader.tensors if t.tensor_type not in (Q.F32, Q.F16))
    kept = sum(lin.matrix.raw.numel() for lin in linears) + model.token_embd.raw.numel()
    assert kept == file_bytes  # the blocks, byte for byte, and no dense copy beside them
    assert linears[0].scratch.buffer.numel() == 0  # small steps never expand a tile
    fp32 = load_model(gguf, weights="fp32", progress=False)
    for ours, theirs in zip(linears, [lin for layer in fp32.layers for lin in layer.linears()]):
        x = torch.randn(3, ours.in_features)
        assert torch.allclose(ours(x), theirs(x), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("load, kept", [(0.5, True), (3.0, False)])
def test_plans_measured_on_a_busy_host_are_not_cached(tmp_path, monkeypatch, load, kept):
    """A plan timed beside other work is used for that run and measured again next start."""
    from workers.weights import paths

    monkeypatch.setattr(paths.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(paths.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(paths, "measure_plan", lambda *args, **kw: (PathPlan.only("int8"), {}))
    cache = PlanCache(tmp_path / "plans.json")
    planner = paths.PathPlanner(block_kernels(), TileScratch(), cache)
    assert planner.plan_for(blocks(Q.Q4_K, 8, 256)) == PathPlan.only("int8")
    assert planner.measured == 1
    assert (tmp_path / "plans.json").exists() is kept


def test_past_the_last_count_each_path_goes_on_at_its_last_segments_slope():
    """The fitted lines follow the small counts, where the dense GEMM pays a fixed cost: there
    the panels win everywhere. Between the last two counts dense gains less per row (0.015 ms
    against 0.02), so past 512 rows it takes over where those segments cross (544 rows)."""
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 512]
    panels = [0.2 + 0.02 * r for r in rows]
    dense = [1.0 + 0.03 * r for r in rows[:-1]] + [1.0 + 0.03 * 128 + 0.015 * 384]
    plan = plan_from_timings(rows, {"int8_panels": panels, "dense": dense})
    assert [plan.path_for(r) for r in (1, 128, 512, 544, 545, 2048)] == \
        ["int8_panels"] * 4 + ["dense"] * 2
    assert plan_from_timings(rows, {"int8_panels": panels, "dense": [1.0 + 0.03 * r for r in rows]}) \
        .path_for(2048) == "int8_panels"  # dense's last segment no better: no switch
    # dense ahead at 512 itself: the counts up to 512 keep the lines' choice, 513 on the tails'
    dense[-1] = 9.0
    plan = plan_from_timings(rows, {"int8_panels": panels, "dense": dense})
    assert [plan.path_for(r) for r in (100, 300, 512, 513, 2048)] == ["int8_panels"] * 3 + ["dense"] * 2
