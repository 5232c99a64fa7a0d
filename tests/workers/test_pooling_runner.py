"""Embeddings in the worker (workers/pooling.py): a tiny random Qwen3 written to GGUF, pooled
by the runner beside a generation in the same steps, equals HF transformers' last_hidden_state
pooled the same way (last token, or the mean over chunks), within 1e-4 cosine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tests.support.hf_gguf import tiny_hf_model, write_gguf
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import TorchPagedBackend
from workers.model.forward import DecoderModel
from workers.runner import ModelRunner
from workers.weights.gguf_loader import load_weights

pytest.importorskip("transformers")

BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = tiny_hf_model("qwen3", seed=3, head_dim=24)
    path = str(tmp_path_factory.mktemp("pool") / "qwen3.gguf")
    write_gguf(hf, path)
    return hf, DecoderModel(load_weights(GGUFFile(path), progress=False))


def hf_hidden(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0]  # [T, hidden], final-normed


def cosine(a: np.ndarray, b: torch.Tensor) -> float:
    b_np = b.numpy().astype(np.float64)
    return float(a @ b_np / (np.linalg.norm(a) * np.linalg.norm(b_np)))


def test_pooled_states_equal_transformers_beside_a_generation(models):
    hf, ours = models
    p = ours.params
    runner = ModelRunner(ours, KVPool.create(PoolShape(p.num_layers, 64, BLOCK_SIZE,
                                                       p.num_kv_heads, p.head_dim)),
                         TorchPagedBackend(BLOCK_SIZE))
    rng = np.random.default_rng(1)
    tokens = {rid: rng.integers(3, p.vocab_size, n).tolist()
              for rid, n in (("gen", 9), ("last", 13), ("mean", 11))}
    blocks = {"gen": [0, 1, 2], "last": [5, 6, 7, 8], "mean": [10, 11, 12]}
    new = [NewRequest("gen", PARAMS, 9, np.asarray(tokens["gen"], np.int32)),
           NewRequest("last", PARAMS, 13, np.asarray(tokens["last"], np.int32), pooling="last"),
           NewRequest("mean", PARAMS, 11, np.asarray(tokens["mean"], np.int32), pooling="mean")]
    step0 = StepPlan.build(0, [("gen", 0, tokens["gen"], blocks["gen"], True),
                               ("last", 0, tokens["last"], blocks["last"], False),
                               ("mean", 0, tokens["mean"][:6], blocks["mean"][:2], False)], new)
    result0 = runner.execute(step0)
    assert result0.request_ids == ["gen"] and result0.pooled_request_ids == ["last"]
    step1 = StepPlan.build(1, [("mean", 6, tokens["mean"][6:], blocks["mean"], False)])
    result1 = runner.execute(step1)
    assert result1.request_ids == [] and result1.pooled_request_ids == ["mean"]
    last_ref = hf_hidden(hf, tokens["last"])[-1]
    mean_ref = hf_hidden(hf, tokens["mean"]).double().mean(dim=0)
    assert cosine(result0.pooled_states[0], last_ref) > 1 - 1e-4
    assert cosine(result1.pooled_states[0], mean_ref) > 1 - 1e-4
    np.testing.assert_allclose(result0.pooled_states[0], last_ref.numpy(), atol=2e-4, rtol=0)


def test_a_mean_chunk_that_does_not_continue_is_refused(models):
    _, ours = models
    p = ours.params
    runner = ModelRunner(ours, KVPool.create(PoolShape(p.num_layers, 16, BLOCK_SIZE,
                                                       p.num_kv_heads, p.head_dim)),
                         TorchPagedBackend(BLOCK_SIZE))
    tokens = list(range(3, 11))
    new = NewRequest("m", PARAMS, 8, np.asarray(tokens, np.int32), pooling="mean")
    runner.execute(StepPlan.build(0, [("m", 0, tokens[:4], [0], False)], [new]))
    plan = StepPlan.build(1, [("m", 2, tokens[2:], [0, 1], False)])  # positions 2, 3 again
    with pytest.raises(ValueError, match="mean pooling"):
        runner.execute(plan)
