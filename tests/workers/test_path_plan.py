"""`--weights auto`'s per-step choice (path_plan.py, block_linear.py, paths.py): the fitted lines
and the plan they give, the cache, measurement on a fake clock, the paths of a BlockLinear
against the dense product, and a model loaded under auto keeping every quantized matrix as
the file's blocks (its tensors checked, not RSS) and computing what fp32 computes."""
from __future__ import annotations

import dataclasses
import math

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
from workers.model.kernel_records import cpu_name, plan_source_digest
from workers.weights.path_plan import (CHECK_ROWS, MEASURE_ROWS, PathPlan, PathTimer, confirm_counts, fit_line, losing_counts, measure_plan,
                                       patch_plan, plan_from_timings, settle_plan, simplest_near_best)
from workers.weights.plan_cache import PlanCache, PlanRecord
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
    seconds = {"int8": [1 + 0.5 * r for r in rows], "int8_panels": [2 + 0.45 * r for r in rows],
               "dense": [10 + 0.2 * r for r in rows]}
    # int8_panels' line drops below int8's at r = 20 and dense's below both at r = 32, but a path
    # within 5% of the fastest keeps the rows if it is the simpler one (earlier in PATHS):
    # int8 until 1 + 0.5 r > 1.05 min (r = 33: over dense's 16.6 by 5.4%), the panels until r = 36
    plan = plan_from_timings(rows, seconds)
    assert plan.steps == ((32, "int8"), (35, "int8_panels"), (1 << 16, "dense"))
    assert [plan.path_for(r) for r in (1, 32, 33, 35, 36, 4096, 10**6)] == \
        ["int8", "int8", "int8_panels", "int8_panels", "dense", "dense", "dense"]
    noisy = {p: list(t) for p, t in seconds.items()}
    noisy["dense"][2] = 0.1  # one wild median moves the fit, it does not carve out a range
    assert len(plan_from_timings(rows, noisy).steps) <= 3
    assert plan_from_timings(rows, {"dense": seconds["dense"]}).steps == ((1 << 16, "dense"),)
    with pytest.raises(ValueError, match="one time per measured row count"):
        plan_from_timings(rows, {"int8": [1.0] * 8})
    assert plan_from_timings(rows, {"int8": [1.0, 1.5], "dense": seconds["dense"]}).path_for(1) == "int8"


def test_a_path_measurement_stopped_timing_does_not_take_larger_counts():
    """dense was timed at 1-4 rows only (far behind there): its flat fitted line lies below
    the others past 512 rows, but it was never measured there, so it takes nothing."""
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 512]
    seconds = {"int8": [2 + 0.5 * r for r in rows], "int8_panels": [4 + 0.2 * r for r in rows],
               "dense": [20.0, 20.5, 21.0]}
    plan = plan_from_timings(rows, seconds)
    assert {path for _, path in plan.steps} == {"int8", "int8_panels"}
    assert plan.path_for(10**5) == "int8_panels" and plan.path_for(1) == "int8"
    # where every path stopped early (not from measure_plan), the plan still names one
    assert plan_from_timings(rows, {"dense": [20.0, 20.5, 21.0]}).path_for(10**5) == "dense"


def test_path_plan_validates_and_describes():
    assert PathPlan(((4, "int8"), (8, "dense"))).describe() == "int8 <= 4 rows < dense"
    assert PathPlan.only("dense").path_for(10**6) == "dense"
    with pytest.raises(ValueError, match="unknown weight paths"):
        PathPlan(((4, "blocks"),))  # the retired fp32 block kernel: a cached plan naming it is measured again
    with pytest.raises(ValueError, match="must rise"):
        PathPlan(((8, "int8"), (4, "dense")))
    with pytest.raises(ValueError, match="unknown weight paths"):
        PathPlan(((4, "int4"),))


def record_of(plan: PathPlan, threads: int = 2) -> PlanRecord:
    return PlanRecord(plan, "Q4_K", (64, 256), threads, "cpu A [0123abcd]", 1.7e9, 0.02)


def test_plan_cache_round_trip_and_bad_files(tmp_path):
    cache = PlanCache(tmp_path / "plans.json")
    key = PlanCache.key("cpu A", "src", "Q4_K", (64, 256), ("int8", "dense"))
    assert key != PlanCache.key("cpu B", "src", "Q4_K", (64, 256), ("int8", "dense"))
    assert cache.get(key) is None
    record = record_of(PathPlan(((12, "int8"), (1 << 16, "dense"))))
    cache.put(key, record)
    cache.put("other", record_of(PathPlan.only("dense")))
    assert PlanCache(tmp_path / "plans.json").get(key) == record
    assert set(cache.records()) == {key, "other"}
    cache.drop("other")
    assert set(cache.records()) == {key}
    (tmp_path / "plans.json").write_text('{"k": {"plan": [[1, "nonsense"]]')
    assert cache.get("k") is None and cache.get(key) is None  # corrupt: measured again
    (tmp_path / "plans.json").write_text('{"k": [[1, "int8"]]}')  # an older version's entry
    assert cache.get("k") is None and cache.records() == {}


def test_a_plan_records_its_thread_count_and_cpu(tmp_path):
    """A record says where it was measured, and a plan measured at another thread count is
    another key: a worker of 4 threads never serves with a 2-thread plan."""
    record = record_of(PathPlan(((12, "int8"), (1 << 16, "dense"))), threads=4)
    again = PlanRecord.from_json(record.to_json())
    assert again == record and (again.threads, again.cpu) == (4, "cpu A [0123abcd]")
    key = PlanCache.key("cpu A", "src", "Q4_K", (64, 256), ("int8",), threads=4)
    assert key != PlanCache.key("cpu A", "src", "Q4_K", (64, 256), ("int8",), threads=2)
    assert cpu_name().endswith("]") and len(cpu_name()) > 11


def test_measure_plan_on_a_fake_clock():
    clock = [0.0]
    cost = {"int8": (1.0, 0.5), "dense": (10.5, 0.2)}  # seconds: a + b * rows; within 5% up to 34.6

    def run(path: str, x: torch.Tensor) -> None:
        a, b = cost[path]
        clock[0] += a + b * x.shape[0]

    plan, seconds = measure_plan(run, 8, ["int8", "dense"], rows=(1, 4, 16, 64), repeats=3,
                                 timer=lambda: clock[0], budget_s=math.inf)
    assert seconds["dense"] == pytest.approx([10.7, 11.3, 13.7, 23.3])
    assert plan.steps == ((34, "int8"), (1 << 16, "dense"))
    cost["dense_bf16"] = (40.0, 1.0)  # 2x behind at every count: timed at the first three only
    plan, seconds = measure_plan(run, 8, ["int8", "dense", "dense_bf16"], rows=(1, 4, 16, 64), repeats=3,
                                 timer=lambda: clock[0], budget_s=math.inf)
    assert len(seconds["dense_bf16"]) == 3 and len(seconds["dense"]) == 4
    assert plan.steps == ((34, "int8"), (1 << 16, "dense"))


def test_a_slow_matrix_stops_adding_row_counts_at_its_budget():
    """A huge head (Gemma 3's 262144 x 640 took 26 s of a fresh start): the measurement stops
    before a count whose predicted time would overrun the budget, never before CHECK_ROWS, and
    the plan still covers every count (each path's last segment goes on)."""
    cost = {"int8": (0.001, 0.002), "int8_panels": (0.02, 0.0004)}  # seconds: a + b * rows
    paths = FakePaths(cost)
    timer = PathTimer(paths.run, 8, list(cost), timer=lambda: paths.clock[0], budget_s=4.0)
    plan, seconds = timer.measure()
    # 1..128 rows cost ~3.2 s; 512 (predicted ~3.9 s more) would overrun 4 s
    assert len(seconds["int8_panels"]) == MEASURE_ROWS.index(128) + 1 and paths.clock[0] <= 4.0
    assert plan.path_for(1) == "int8" and plan.path_for(512) == "int8_panels" and plan.path_for(4096) == "int8_panels"
    unbounded = PathTimer(paths.run, 8, list(cost), timer=lambda: paths.clock[0], budget_s=math.inf)
    assert len(unbounded.measure()[1]["int8_panels"]) == len(MEASURE_ROWS)
    # far over the budget from the first count: the check's counts are timed all the same
    slow = FakePaths({"int8": (10.0, 1.0), "int8_panels": (20.0, 0.5)})
    _, seconds = PathTimer(slow.run, 8, list(slow.cost), timer=lambda: slow.clock[0], budget_s=4.0).measure()
    assert len(seconds["int8"]) == MEASURE_ROWS.index(max(CHECK_ROWS)) + 1
    settled = settle_plan(None, PathTimer(slow.run, 8, list(slow.cost), timer=lambda: slow.clock[0], budget_s=4.0))
    assert max(settled.check) <= max(CHECK_ROWS) and settled.plan.path_for(1) == "int8"


def test_a_path_behind_at_few_rows_but_catching_up_is_timed_on():
    """The int8 panels compute 8 rows as cheaply as 1: far behind the per-row kernel at 1-4
    rows of a wide matrix, ahead from a few dozen. Dropping them for being 2x behind early
    sent a 7B model's prefill chunks to a slower path."""
    clock = [0.0]
    cost = {"int8": (1.0, 0.5), "int8_panels": (30.0, 0.1), "dense": (40.0, 1.0)}

    def run(path: str, x: torch.Tensor) -> None:
        a, b = cost[path]
        clock[0] += a + b * x.shape[0]

    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    plan, seconds = measure_plan(run, 8, list(cost), rows=rows, repeats=3, timer=lambda: clock[0],
                                   budget_s=math.inf)
    assert len(seconds["int8_panels"]) == len(rows)  # 20x behind at first, but catching up
    assert len(seconds["dense"]) == 3  # behind and falling further behind
    assert plan.path_for(8) == "int8" and plan.path_for(128) == "int8_panels"
    assert plan.steps[0] == (77, "int8")  # 1 + 0.5 r = 1.05 (30 + 0.1 r) at r = 77.2


def blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> BlockMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return block_matrix(quantize(w, qtype), qtype, (rows, cols))


@needs_kernels
@pytest.mark.parametrize("dtype_path", ["dense", "int8", "int8_panels"])
def test_block_linear_paths_equal_the_dense_product(dtype_path):
    if dtype_path == "int8_panels" and not block_kernels().has_panels:
        pytest.skip("the int8 panels need AVX2")
    matrix = blocks(Q.Q6_K, 72, 512)
    scratch = TileScratch(max_bytes=16 * 512 * 4)  # 16 rows a tile: 5 tiles, the last partial
    linear = BlockLinear(matrix, block_kernels(), PathPlan.only(dtype_path), scratch)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    reference = x.double() @ matrix.dense().double().T
    tolerance = 2e-2 if dtype_path != "dense" else 1e-4  # int8: x rounded to 8 bits per 32 values
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
    model = load_model(GGUFFile(path), weights="auto", progress=False, plan=PathPlan.only("dense"))
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


def test_past_the_last_count_each_path_goes_on_at_its_last_segments_slope():
    """The fitted lines follow the small counts, where the dense GEMM pays a fixed cost: there
    the panels win everywhere. Between the last two counts dense gains less per row (0.015 ms
    against 0.02), so past 512 rows it takes over where those segments cross (544 rows), or
    rather where the panels fall 5% behind (674 rows: a near tie keeps the simpler path)."""
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 512]
    panels = [0.2 + 0.02 * r for r in rows]
    dense = [1.0 + 0.03 * r for r in rows[:-1]] + [1.0 + 0.03 * 128 + 0.015 * 384]
    plan = plan_from_timings(rows, {"int8_panels": panels, "dense": dense})
    assert [plan.path_for(r) for r in (1, 128, 512, 544, 674, 675, 2048)] == \
        ["int8_panels"] * 5 + ["dense"] * 2
    assert plan_from_timings(rows, {"int8_panels": panels, "dense": [1.0 + 0.03 * r for r in rows]}) \
        .path_for(2048) == "int8_panels"  # dense's last segment no better: no switch
    # dense ahead at 512 itself: the counts up to 512 keep the lines' choice, 513 on the tails'
    dense[-1] = 9.0
    plan = plan_from_timings(rows, {"int8_panels": panels, "dense": dense})
    assert [plan.path_for(r) for r in (100, 300, 512, 513, 2048)] == ["int8_panels"] * 3 + ["dense"] * 2


def test_a_near_tie_keeps_the_simpler_path():
    """int8 within 5% of the dense tile at every count: no dense range. The panels 3% ahead of
    dense: the panels (earlier in PATHS). Beyond the margin the faster path takes the rows."""
    assert simplest_near_best({"dense": 1.0, "int8": 1.04}) == "int8"
    assert simplest_near_best({"dense": 1.0, "int8": 1.06}) == "dense"
    assert simplest_near_best({"dense_bf16": 1.0, "int8_panels": 1.03, "dense": 0.99}) == "int8_panels"
    rows = [1, 2, 4, 8, 16, 32]
    dense = [1 + 0.5 * r for r in rows]
    assert plan_from_timings(rows, {"dense": dense, "int8": [1.04 * t for t in dense]}).describe() == "int8 always"
    assert plan_from_timings(rows, {"dense": dense, "int8": [1.08 * t for t in dense]}).describe() == "dense always"


def test_losing_counts_and_patching_a_plan_at_them():
    plan = PathPlan(((4, "int8"), (1 << 16, "dense")))
    times = {1: {"int8": 1.0, "dense": 5.0}, 16: {"int8": 1.0, "dense": 1.2}, 8: {"int8": 1.0, "dense": 1.09}}
    assert losing_counts(plan, times) == [16]  # 8: dense within 10% of int8
    patched = patch_plan(plan, times)
    assert patched.steps == ((4, "int8"), (15, "dense"), (16, "int8"), (1 << 16, "dense"))
    assert losing_counts(patched, times) == []
    assert patch_plan(plan, {1: {"int8": 1.0, "dense": 5.0}}) is plan
    tail = patch_plan(PathPlan.only("dense"), {1 << 17: {"dense": 2.0, "int8": 1.0}})
    assert [tail.path_for(r) for r in (1, (1 << 17) - 1, 1 << 17, (1 << 17) + 1)] == ["dense", "dense", "int8", "dense"]
    assert losing_counts(PathPlan.only("dense_bf16"), {1: {"int8": 1.0}}) == [1]  # a path not offered now
    assert confirm_counts(PathPlan(((5, "int8"), (600, "int8_panels"), (1 << 16, "dense")))) == [1, 5, 6, 16]


class FakePaths:
    """Paths whose calls cost a + b * rows seconds on a fake clock (`cost` may change between
    calls, e.g. a burst of load while one path is timed)."""

    def __init__(self, cost: dict[str, tuple[float, float]]) -> None:
        self.cost, self.clock, self.calls = cost, [0.0], 0

    def run(self, path: str, x: torch.Tensor) -> None:
        a, b = self.cost[path]
        self.clock[0] += a + b * x.shape[0]
        self.calls += 1

    def timer(self, rows=(1, 4, 16, 64)) -> PathTimer:
        return PathTimer(self.run, 8, list(self.cost), timer=lambda: self.clock[0], rows=rows, budget_s=math.inf)


def test_a_poisoned_plan_is_caught_by_the_start_check_and_replaced():
    """The cached plan says int8_panels for every count (measured under load), where int8 is 3x
    faster at one row: the check at 1 and 16 rows catches it and a fresh plan replaces it. A
    cached plan that still wins is kept after the check alone, without a measurement."""
    paths = FakePaths({"int8": (1.0, 0.5), "int8_panels": (3.0, 1.5), "dense": (10.5, 0.2)})
    settled = settle_plan(PathPlan.only("int8_panels"), paths.timer())
    assert settled.how == "replaced" and settled.plan.path_for(1) == "int8" and settled.plan.path_for(16) == "int8"
    assert losing_counts(settled.plan, settled.check) == []
    calls = paths.calls
    kept = settle_plan(settled.plan, paths.timer())
    assert kept.how == "checked" and kept.plan == settled.plan and sorted(kept.check) == [1, 16]
    assert paths.calls - calls == 3 * (1 + 3) * 2  # 3 paths, a warm-up and 3 rounds, at 2 counts
    assert settle_plan(None, paths.timer()).how == "measured"


def test_a_fresh_plan_that_loses_its_confirmation_is_measured_again_and_patched():
    """A burst of load while the first measurement timed int8 made dense look best at every
    count; the confirmation (load gone) finds int8 3x faster at one row, so everything is
    measured again, and the plan follows the faster of the two passes."""
    paths = FakePaths({"int8": (1.0, 0.5), "dense": (10.5, 0.2)})
    slow_first = {"left": 6 * 3}  # the first measurement's int8 calls: a warm-up and 5 rounds at 1, 4, 16
    # rows, after which int8, far behind and falling further, is timed no more

    def run(path: str, x: torch.Tensor) -> None:
        if path == "int8" and slow_first["left"] > 0:
            slow_first["left"] -= 1
            paths.clock[0] += 100.0
        FakePaths.run(paths, path, x)

    timer = PathTimer(run, 8, ["int8", "dense"], timer=lambda: paths.clock[0], rows=(1, 4, 16, 64),
                      budget_s=math.inf)
    settled = settle_plan(None, timer)
    assert settled.how == "measured"
    assert settled.plan.path_for(1) == "int8" and settled.plan.path_for(16) == "int8"
    assert settled.plan.path_for(64) == "dense"  # 1 + 32 against 10.5 + 12.8
    assert 16 in settled.check and settled.check[1]["int8"] == pytest.approx(1.5)


def faked_planner(tmp_path, monkeypatch, busy: float = 0.0):
    """(cache, planner, key of the Q4_K 8 x 256 test matrix): a PathPlanner whose candidates run
    on FakePaths' clock and whose busy probe reads `busy`."""
    from workers.weights import paths as paths_module

    fake = FakePaths({"int8": (1.0, 0.5), "int8_panels": (3.0, 1.5), "dense": (10.5, 0.2)})
    probe = type("Probe", (), {"start": lambda self: self, "share": lambda self: busy})
    monkeypatch.setattr(paths_module, "BusyProbe", probe)
    monkeypatch.setattr(paths_module, "PathTimer",
                        lambda run, in_features, paths: PathTimer(fake.run, in_features, list(fake.cost),
                                                                  timer=lambda: fake.clock[0], rows=(1, 4, 16, 64),
                                                                  budget_s=math.inf))
    cache = PlanCache(tmp_path / "plans.json")
    planner = paths_module.PathPlanner(block_kernels(), TileScratch(), cache)
    planner.paths = tuple(fake.cost)
    return cache, planner, PlanCache.key(paths_module.cpu_id(), planner._source, "Q4_K", (8, 256), planner.paths)


@needs_kernels
@pytest.mark.parametrize("busy, kept", [(0.02, True), (0.5, False)])
def test_the_planner_replaces_a_poisoned_record_and_keeps_only_quiet_measurements(tmp_path, monkeypatch, busy, kept):
    """A record that loses its start check is measured again: kept (with the thread count and
    CPU it was measured at) where other processes left the CPUs quiet meanwhile, and dropped
    where they did not, so the next start measures afresh instead of trusting it."""
    cache, planner, key = faked_planner(tmp_path, monkeypatch, busy)
    cache.put(key, PlanRecord(PathPlan.only("int8_panels"), "Q4_K", (8, 256), torch.get_num_threads(), cpu_name()))
    plan = planner.plan_for(blocks(Q.Q4_K, 8, 256))
    assert plan.path_for(1) == "int8" and planner.measured == 1
    record = cache.get(key)
    if kept:
        assert record.plan == plan and record.threads == torch.get_num_threads() and record.cpu == cpu_name()
        assert record.others_busy == busy and record.measured_at > 0
        assert record.source == plan_source_digest() and len(record.source) == 12
    else:
        assert record is None


@needs_kernels
def test_a_record_that_passes_its_check_is_marked_with_the_kernel_source(tmp_path, monkeypatch):
    """A record kept before records named their kernel source passes its start check under its
    key (which holds the source): it is written back with the source's digest, by which
    `justapi doctor` tells the plans a start uses from other versions' - nothing is measured."""
    cache, planner, key = faked_planner(tmp_path, monkeypatch)
    old = PlanRecord(PathPlan.only("int8"), "Q4_K", (8, 256), torch.get_num_threads(), cpu_name(), 1.7e9, 0.01)
    cache.put(key, old)
    assert cache.get(key).source == ""
    assert planner.plan_for(blocks(Q.Q4_K, 8, 256)) == PathPlan.only("int8") and planner.measured == 0
    assert cache.get(key) == dataclasses.replace(old, source=plan_source_digest())
