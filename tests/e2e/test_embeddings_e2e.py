"""/v1/embeddings end to end through `justapi serve` on a tiny random Qwen3 whose GGUF says
pooling_type = last (an embedding model's file): the official openai client's embeddings of
token-id and text inputs equal HF transformers' reference (last-token pooling of
last_hidden_state, L2-normalized: Qwen3-Embedding's) within 1e-4 cosine, batched with a
completion on the same engine."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from tests.support.hf_gguf import tiny_hf_model, write_gguf
from tools.harness import ServedPool

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")


def reference(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        last = hf.model(torch.tensor([tokens])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=0).numpy()


def test_embeddings_equal_transformers_through_the_server(tmp_path):
    hf = tiny_hf_model("qwen3", seed=11, head_dim=24)
    path = write_gguf(hf, str(tmp_path / "qwen3-embed.gguf"), pooling_type=3)
    rng = np.random.default_rng(2)
    inputs = [rng.integers(3, 128, n).tolist() for n in (5, 17, 33, 17)]
    inputs[3][:16] = inputs[1][:16]  # shares a cached block with input 1
    with ServedPool("--model", path, "--pool-blocks", "64", "--log-level", "warning") as pool:
        client = openai.OpenAI(api_key="x", base_url=f"{pool.base_url}/v1")
        with ThreadPoolExecutor(2) as executor:
            completion = executor.submit(httpx.post, f"{pool.base_url}/v1/completions", json={
                "prompt": inputs[0], "max_tokens": 16, "temperature": 0}, timeout=120)
            result = client.embeddings.create(input=inputs, model=hf_name(pool))
            assert completion.result().status_code == 200
        assert [d.index for d in result.data] == [0, 1, 2, 3]
        for item, tokens in zip(result.data, inputs):
            vector = np.asarray(item.embedding, dtype=np.float64)
            expected = reference(hf, tokens).astype(np.float64)
            assert len(vector) == hf.config.hidden_size
            assert abs(np.linalg.norm(vector) - 1) < 1e-5
            assert float(vector @ expected) > 1 - 1e-4
        assert result.usage.prompt_tokens == sum(len(t) for t in inputs)
        text = client.embeddings.create(input="a short text", model=hf_name(pool),
                                        encoding_format="float")
        assert len(text.data[0].embedding) == hf.config.hidden_size
        refused = httpx.post(f"{pool.base_url}/v1/embeddings", json={"input": "x",
                                                                     "dimensions": 8})
        assert refused.status_code == 400  # not a Matryoshka model


def hf_name(pool: ServedPool) -> str:
    return httpx.get(f"{pool.base_url}/v1/models").json()["data"][0]["id"]
