"""`python -m tools.bench attention`: both pool dtypes timed per shape, with their ratio."""
from __future__ import annotations

import pytest

from tools.bench.attention import layer_times, main
from workers.model.cpu_kernels import paged_attention

pytestmark = pytest.mark.skipif(paged_attention() is None, reason="no C compiler: no CPU attention kernel")


def test_each_dtype_is_timed_per_shape(capsys: pytest.CaptureFixture[str]) -> None:
    times = layer_times(3, 50, ["float32", "bfloat16"], layers=2, rounds=1, heads=4, kv_heads=2, head_dim=16)
    assert set(times) == {"float32", "bfloat16"} and all(t > 0 for t in times.values())
    main(["--shapes", "2x40,1x20", "--layers", "2", "--rounds", "1", "--heads", "4,1,16"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("torch threads") and len(lines) == 3
    assert all("float32" in line and "bfloat16" in line and line.endswith("x") for line in lines[1:])


def test_prompt_chunks_are_timed_per_variant_with_their_ratio_to_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.bench.attention import chunk_times, chunk_variants
    variants = chunk_variants()
    assert variants[0] == "fp32 products" and variants[-1] == "sdpa"
    times = chunk_times(2, 20, 30, variants, layers=2, rounds=1, heads=4, kv_heads=2, head_dim=32)
    assert set(times) == set(variants) and all(t > 0 for t in times.values())
    main(["--chunks", "2x20@30,1x40", "--layers", "2", "--rounds", "1", "--heads", "4,2,32"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("torch threads") and len(lines) == 3
    assert all(line.count("(") == len(variants) and "fp32 products" in line and "(1.00)" in line for line in lines[1:])
