"""/v1/embeddings over the real app and engine link (a fake scheduler pools): one pooling
request per input through the same path as generation, vectors back in input order,
normalized, Matryoshka `dimensions`, base64, and the refusals - through httpx and the
official openai client."""
from __future__ import annotations

import base64

import numpy as np
import openai

from tests.support.api_fake_scheduler import FAKE_HIDDEN, fake_embedding
from tests.support.api_stack import run, serving_stack, tokenizer


def unit(vector: np.ndarray) -> np.ndarray:
    return (vector / np.linalg.norm(vector.astype(np.float64))).astype(np.float32)


def test_batched_text_and_token_inputs_come_back_in_order_normalized():
    async def scenario() -> None:
        async with serving_stack() as stack:
            response = await stack.http.post("/v1/embeddings", json={
                "input": ["Hello world", "Paris is big", "Hi"], "priority": 0})
            assert response.status_code == 200
            body = response.json()
            submitted = stack.fake.submitted
            assert [r.pooling for r in submitted] == ["last"] * 3
            texts = ["Hello world", "Paris is big", "Hi"]
            for item, text, request in zip(body["data"], texts, submitted):
                ids = tokenizer().encode(text, add_special_tokens=True)
                assert request.prompt_token_ids.tolist() == ids
            by_index = {item["index"]: item["embedding"] for item in body["data"]}
            for i, request in enumerate(submitted):
                expected = unit(fake_embedding(request.prompt_token_ids))
                np.testing.assert_allclose(by_index[i], expected, rtol=1e-6)
            total = sum(len(r.prompt_token_ids) for r in submitted)
            assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
            tokens = await stack.http.post("/v1/embeddings", json={"input": [5, 6, 7]})
            assert stack.fake.submitted[-1].prompt_token_ids.tolist() == [5, 6, 7]
            np.testing.assert_allclose(tokens.json()["data"][0]["embedding"],
                                       unit(fake_embedding(np.asarray([5, 6, 7]))), rtol=1e-6)
    run(scenario)


def test_matryoshka_dimensions_cut_then_renormalize_and_base64_is_float32():
    async def scenario() -> None:
        async with serving_stack(is_matryoshka=True) as stack:
            response = await stack.http.post("/v1/embeddings", json={
                "input": [[5, 6, 7, 9]], "dimensions": 3, "encoding_format": "base64"})
            raw = base64.b64decode(response.json()["data"][0]["embedding"])
            vector = np.frombuffer(raw, dtype="<f4")
            np.testing.assert_allclose(vector, unit(fake_embedding(np.asarray([5, 6, 7, 9]))[:3]),
                                       rtol=1e-6)
    run(scenario)


def test_refusals_are_400s_and_submit_nothing():
    async def scenario() -> None:
        async with serving_stack() as stack:  # not Matryoshka
            bad = [{"input": "x", "dimensions": 3}, {"input": []}, {"input": ""},
                   {"input": [[1, 2], [10 ** 9]]}, {"input": "x", "encoding_format": "int8"},
                   {"input": "x", "priority": 2}, {"input": "x", "model": "other"}]
            for body in bad:
                response = await stack.http.post("/v1/embeddings", json=body)
                assert response.status_code in (400, 404), (body, response.text)
                assert "error" in response.json()
            ok = await stack.http.post("/v1/embeddings", json={"input": "x",
                                                               "dimensions": FAKE_HIDDEN})
            assert ok.status_code == 200
            assert len(stack.fake.submitted) == 1
        async with serving_stack(pooling="") as stack:  # a model without pooling
            response = await stack.http.post("/v1/embeddings", json={"input": "x"})
            assert response.status_code == 400 and "--pooling" in response.json()["error"]["message"]
    run(scenario)


def test_the_openai_client_gets_its_embeddings():
    async def scenario() -> None:
        async with serving_stack() as stack:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1",
                                        http_client=stack.http)
            result = await client.embeddings.create(model="smollm2-test",
                                                    input=["alpha", "beta gamma"])
            assert [d.index for d in result.data] == [0, 1]
            for item, request in zip(result.data, stack.fake.submitted):
                np.testing.assert_allclose(item.embedding,
                                           unit(fake_embedding(request.prompt_token_ids)),
                                           rtol=1e-6)
    run(scenario)
