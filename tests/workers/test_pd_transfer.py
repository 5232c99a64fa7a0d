"""The decode worker's side of the KV hand-off (workers/kv/transfer.py) over real KV pools:
a source pool in another shared-memory segment is mapped once through its PoolInfo and its
blocks land, every layer's K and V, at the destination ids; failures answer with the error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from justapi.wire.protocol import CopyBlocks
from workers.kv.pool import KVPool, PoolShape
from workers.kv.transfer import BlockCopier

SHAPE = PoolShape(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)


def order(copy_id: int, src: KVPool, src_ids: list[int], dst_ids: list[int],
          with_info: bool = True) -> CopyBlocks:
    return CopyBlocks(copy_id=copy_id, src_pool=src.pool_id,
                      src_block_ids=np.asarray(src_ids, np.int32),
                      dst_block_ids=np.asarray(dst_ids, np.int32),
                      src=src.info() if with_info else None)


def test_copies_blocks_from_another_segment_mapped_once():
    with KVPool.create(SHAPE, "shm", pool_id=0) as prefill, \
            KVPool.create(SHAPE, "shm", pool_id=1) as decode:
        prefill.tensor.copy_(torch.randn(SHAPE.dims))
        copier = BlockCopier(decode, worker_id=1)
        ack = copier.execute(order(1, prefill, [5, 2, 7], [0, 1, 3]))
        assert (ack.copy_id, ack.worker_id, ack.num_blocks, ack.error) == (1, 1, 3, None)
        for src, dst in ((5, 0), (2, 1), (7, 3)):
            assert torch.equal(decode.tensor[:, :, dst], prefill.tensor[:, :, src])
        assert not decode.tensor[:, :, 2].any()  # untouched blocks stay as they were
        prefill.tensor[:, :, 6] = 1.0  # the mapping is live and reused for the next order
        assert copier.execute(order(2, prefill, [6], [4])).error is None
        assert torch.equal(decode.tensor[:, :, 4], prefill.tensor[:, :, 6])
        assert len(copier._sources) == 1
        copier.close()


def test_own_pool_copy_and_errors():
    with KVPool.create(SHAPE, "shm", pool_id=0) as pool:
        pool.tensor.copy_(torch.randn(SHAPE.dims))
        copier = BlockCopier(pool, worker_id=0)
        assert copier.execute(order(1, pool, [1], [6], with_info=False)).error is None
        assert torch.equal(pool.tensor[:, :, 6], pool.tensor[:, :, 1])
        bad = copier.execute(order(2, pool, [99], [0]))
        assert bad.num_blocks == 0 and "out of range" in bad.error
        gone = pool.info()
        missing = CopyBlocks(3, 5, np.zeros(1, np.int32), np.zeros(1, np.int32),
                             src=type(gone)(**{**gone.__dict__, "pool_id": 5,
                                               "handle": "justapi-kv-0-missing"}))
        assert "does not exist" in copier.execute(missing).error
        no_handle = CopyBlocks(4, 5, np.zeros(1, np.int32), np.zeros(1, np.int32))
        assert "no handle for source pool 5" in copier.execute(no_handle).error
        copier.close()


def test_cpu_threads_favour_prefill_workers(monkeypatch):
    from justapi.config.serve import build_config
    from justapi.launch.child import ChildSpec, Endpoints
    from workers import link

    monkeypatch.setattr(link.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(link.torch, "set_num_threads", lambda n: None)

    def threads(values: dict, index: int) -> int:
        spec = ChildSpec("worker", index, build_config(values, {}), Endpoints.in_dir("/tmp/x"), "")
        return link.set_cpu_threads(spec)

    assert [threads({"workers": 2}, i) for i in range(2)] == [4, 4]
    assert [threads({"pd": "2:1"}, i) for i in range(3)] == [4, 4, 1]  # decode: one thread
    assert [threads({"workers": 2, "threads": 1}, i) for i in range(2)] == [1, 1]  # --threads wins
    assert [threads({"pd": "2:1", "threads": 3}, i) for i in range(3)] == [3, 3, 3]


def test_cpu_workers_sleep_at_openmp_barriers(monkeypatch):
    """Every CPU worker starts with OMP_WAIT_POLICY=PASSIVE (a spinning thread would take the
    core the frontend and scheduler need); a value the user set is kept; GPU workers and
    other roles are left alone."""
    from types import SimpleNamespace

    from justapi.config.serve import build_config
    from justapi.launch.launcher import Launcher

    def env(role: str, **values) -> dict:
        fake = SimpleNamespace(config=build_config(values, {}), _api_key="", model=_model(1, 64))
        return Launcher.child_env(fake, role)  # type: ignore[arg-type]

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert env("worker")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in env("frontend")
    assert "OMP_WAIT_POLICY" not in env("worker", device="cuda")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert env("worker")["OMP_WAIT_POLICY"] == "ACTIVE"


def _model(num_layers: int, hidden_size: int):
    from justapi.model.info import ModelInfo
    return ModelInfo(path="", name="m", architecture="llama", num_layers=num_layers,
                     hidden_size=hidden_size, num_heads=4, num_kv_heads=2, head_dim=16,
                     context_length=2048, vocab_size=256)


def test_cpu_workers_spin_briefly_for_big_models(monkeypatch):
    """cpu_spin -1 (auto): a SmolLM2-sized model's CPU workers spin 10,000 rounds at a barrier
    before they sleep, a tiny model's sleep at once, and so do workers whose threads outnumber
    the cores; an explicit --cpu-spin wins over the environment, auto keeps what the user
    exported; GPU workers and other roles get none."""
    from types import SimpleNamespace

    from justapi.config.serve import build_config
    from justapi.launch.launcher import AUTO_CPU_SPIN, Launcher, cpu_spin_count

    smollm2, tiny = _model(30, 576), _model(1, 64)

    def spin(model, role: str = "worker", **values) -> str | None:
        fake = SimpleNamespace(config=build_config(values, {}), _api_key="", model=model)
        return Launcher.child_env(fake, role).get("GOMP_SPINCOUNT")  # type: ignore[arg-type]

    def count(model, cores: int = 2, **values) -> int:
        return cpu_spin_count(build_config(values, {}), model, cores)

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert count(smollm2) == AUTO_CPU_SPIN == 10_000
    assert count(tiny) == 0 and count(tiny, cpu_spin=7) == 7
    assert count(smollm2, workers=2) == 10_000  # 1 + 1 threads on 2 cores
    # threads outnumbering the cores (PD: the prefill workers take every core and each decode
    # worker one more; or 4 asked for): sleep at once
    assert count(smollm2, pd="1:1") == 0 and count(smollm2, cores=8, pd="2:1") == 0
    assert count(smollm2, pd="1:1", threads=1) == 10_000  # 1 + 1 <= 2
    assert count(smollm2, threads=4) == 0 and count(smollm2, threads=4, cpu_spin=5) == 5
    assert spin(smollm2) == "10000" and spin(tiny) is None
    assert spin(smollm2, "frontend") is None and spin(smollm2, device="cuda") is None
    assert spin(tiny, cpu_spin=3000) == "3000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert spin(smollm2) == "500" and spin(tiny) == "500"  # auto: the user's export stays
    assert spin(smollm2, cpu_spin=0) is None  # on purpose: sleep at once
    assert spin(smollm2, cpu_spin=2000) == "2000"
    with pytest.raises(ValueError, match="cpu-spin"):
        build_config({"cpu_spin": -2}, {})
