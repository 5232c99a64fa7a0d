"""Serve config: TOML keys named as the flags, flags win, unknown keys and bad values named."""
from __future__ import annotations

import pytest

from justapi.config.sections import ConfigError
from justapi.config.serve import AUTO_DECODE_STEPS, ServeConfig, build_config, load_toml


def test_file_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('max-seqs = 8\nblock_size = 32\nport = 9000\nmodel = "x.gguf"\n')
    config = build_config(load_toml(str(path)), {"port": 9001})
    assert config.scheduler.max_seqs == 8
    assert config.cache.block_size == 32
    assert config.server.port == 9001
    assert config.model.model == "x.gguf"


def test_defaults_and_roundtrip():
    config = build_config({}, {})
    assert config.server.host == "127.0.0.1"
    assert config.scheduler.max_seqs == 32 and config.scheduler.chunk_size == 512
    assert ServeConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("values, key", [
    ({"no-such-key": 1}, "no-such-key"),
    ({"max-seqs": 0}, "max-seqs"),
    ({"block-size": 3}, "block-size"),
    ({"port": 70000}, "port"),
    ({"policy": "random"}, "policy"),
    ({"device": "tpu"}, "device"),
    ({"threads": -1}, "threads"),
    ({"threads": "2"}, "threads"),
    ({"kv-cache-dtype": "fp8"}, "kv-cache-dtype"),
    ({"kv-cache-dtype": "float32", "device": "cuda"}, "kv-cache-dtype float32 is CPU only"),
])
def test_bad_values_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        build_config(values, {})


def test_bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("max-seqs = = 3")
    with pytest.raises(ConfigError, match="TOML"):
        load_toml(str(path))
    path.write_text("[scheduler]\nmax-seqs = 3\n")
    with pytest.raises(ConfigError, match="flat"):
        load_toml(str(path))


def test_cpu_workers_overlap_only_with_a_core_to_spare():
    def config(**sections: dict) -> ServeConfig:
        return ServeConfig.from_dict(sections)

    assert not config().overlaps_steps(cores=2)  # one worker takes both cores
    assert config(server={"threads": 1}).overlaps_steps(cores=2)
    assert not config(server={"workers": 2}).overlaps_steps(cores=2)
    assert config().overlaps_steps(cores=3) is False  # 3 cores, one worker: all 3 threads
    assert config(server={"threads": 2}).overlaps_steps(cores=3)
    assert config(model={"device": "cuda"}).overlaps_steps(cores=1)
    assert not config(model={"device": "cuda"}, scheduler={"overlap": False}).overlaps_steps(cores=8)
    assert not config(server={"threads": 1}, scheduler={"overlap": False}).overlaps_steps(cores=8)


def test_control_processes_nice_only_where_cpu_workers_take_every_core():
    def config(**sections: dict) -> ServeConfig:
        return ServeConfig.from_dict(sections)

    assert config().control_niceness(cores=2) == 10  # one worker's threads take both cores
    assert config(server={"threads": 1}).control_niceness(cores=2) == 0
    assert config(server={"workers": 2}).control_niceness(cores=2) == 10
    assert config(server={"threads": 2}).control_niceness(cores=3) == 0
    assert config(model={"device": "cuda"}).control_niceness(cores=1) == 0
    assert config(server={"launcher": "ray"}).control_niceness(cores=2) == 0
    assert config(server={"control_nice": 0}).control_niceness(cores=2) == 0  # set: it wins
    assert config(server={"control_nice": 5, "threads": 1}).control_niceness(cores=8) == 5
    with pytest.raises(ConfigError, match="control-nice"):
        config(server={"control_nice": 20})


def test_multi_step_decoding_only_where_cpu_workers_take_every_core():
    def config(**sections: dict) -> ServeConfig:
        return ServeConfig.from_dict(sections)

    assert config().decode_steps_for(cores=2) == AUTO_DECODE_STEPS  # threads take both cores
    assert config(server={"threads": 1}).decode_steps_for(cores=2) == 1  # overlap instead
    assert config(server={"workers": 2}).decode_steps_for(cores=2) == AUTO_DECODE_STEPS
    assert config(model={"device": "cuda"}).decode_steps_for(cores=1) == 1
    assert config(server={"launcher": "ray"}).decode_steps_for(cores=2) == 1
    assert config(scheduler={"decode_steps": 1}).decode_steps_for(cores=2) == 1  # set: it wins
    assert config(scheduler={"decode_steps": 6}, model={"device": "cuda"}).decode_steps_for(cores=8) == 6
    for bad in (0, -2, 65, 1.5):
        with pytest.raises(ConfigError, match="decode-steps"):
            config(scheduler={"decode_steps": bad})


def test_the_kv_cache_dtype_sizes_the_cpu_pool():
    """auto: f16 on CPUs, bf16 on GPUs; a 16-bit CPU pool's blocks take half the bytes of an
    fp32 one's (float32), so the same memory fraction holds twice the blocks, and the segment
    the workers map is planned in the pool's dtype."""
    from justapi.launch import shm_pool
    from justapi.model.info import ModelInfo
    config = build_config({}, {})
    assert (config.cache.pool_dtype("cpu"), config.cache.pool_dtype("cuda")) == ("float16", "bfloat16")
    from justapi.launch.memory_limits import MemoryLimits
    limits = MemoryLimits(available=1 << 30)
    model = ModelInfo(path="m.gguf", name="m", architecture="llama", num_layers=30, hidden_size=576, num_heads=9,
                      num_kv_heads=3, head_dim=64, context_length=8192, vocab_size=49152)
    plans = {}
    for dtype in ("float32", "auto", "bfloat16"):
        config = build_config({}, {"kv-cache-dtype": dtype, "kv-memory-fraction": 0.05})
        plans[dtype] = shm_pool.plan_cpu_pool(model, config.cache, config.scheduler, limits=limits)
    assert (plans["float32"].dtype, plans["auto"].dtype, plans["bfloat16"].dtype) == ("float32", "float16", "bfloat16")
    assert plans["auto"].bytes_per_block == plans["bfloat16"].bytes_per_block
    assert plans["auto"].bytes_per_block * 2 == plans["float32"].bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4
    assert plans["auto"].num_blocks // 2 == plans["float32"].num_blocks  # (floors of the same budget)
    segment = shm_pool.SharedPoolSegment.create(plans["auto"])
    try:  # what the workers map
        assert segment.describe()["dtype"] == "float16" and segment.shm.size >= plans["auto"].num_bytes
    finally:
        segment.unlink()


def test_the_engine_refuses_an_fp32_cache_on_a_gpu_before_looking_for_one():
    """The same rule as serve's (CacheConfig.pool_dtype), checked before the GPU and the model."""
    from workers.engine import LLMEngine
    with pytest.raises(ConfigError, match="kv-cache-dtype float32 is CPU only"):
        LLMEngine("no-such.gguf", device="cuda", kv_cache_dtype="float32")
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        LLMEngine("no-such.gguf", kv_cache_dtype="fp8")
