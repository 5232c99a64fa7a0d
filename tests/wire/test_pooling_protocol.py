"""Embeddings on the wire: pooled hidden states travel as raw float32 frames from the worker
(StepResult) and on to the frontend (TokenDeltas), bit for bit; bad shapes and poolings are
refused."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

from justapi.sampling import SamplingParams
from justapi.wire.codec import ProtocolError, decode, encode
from justapi.wire.protocol import NewRequest, StepResult, SubmitRequest, TokenDeltas

STATES = np.random.default_rng(0).standard_normal((2, 896)).astype(np.float32)


def roundtrip(message: object) -> object:
    return decode([bytes(f) for f in encode(message)])


def test_pooled_states_come_back_from_the_worker_as_raw_frames():
    result = StepResult(step_id=4, worker_id=0, request_ids=[], num_sampled=np.zeros(0, np.int32),
                        sampled_token_ids=np.zeros(0, np.int32),
                        pooled_request_ids=["e1", "e2"], pooled_states=STATES)
    frames = encode(result)
    header = orjson.loads(bytes(frames[0]))
    assert header["pooled_states"]["dtype"] == "<f4" and header["pooled_states"]["shape"] == [2, 896]
    assert len(bytes(frames[0])) < 2000  # the floats are not in the JSON header
    back = roundtrip(result)
    assert back.pooled_request_ids == ["e1", "e2"]
    assert back.pooled_states.dtype == np.float32
    assert np.array_equal(back.pooled_states, STATES)


def test_embeddings_reach_the_frontend_bit_for_bit():
    deltas = TokenDeltas(step_id=4, request_ids=["e1", "e2"], num_new_tokens=np.zeros(2, np.int32),
                         token_ids=np.zeros(0, np.int32), finish_reasons=["stop", "stop"],
                         embedding_request_ids=["e1", "e2"], embeddings=STATES)
    back = roundtrip(deltas)
    assert back.embedding_request_ids == ["e1", "e2"] and np.array_equal(back.embeddings, STATES)


def test_pooling_requests_roundtrip_and_bad_poolings_are_refused():
    submit = SubmitRequest("e1", np.arange(5, dtype=np.int32), SamplingParams(max_tokens=1),
                           pooling="mean")
    assert roundtrip(submit).pooling == "mean"
    new = NewRequest("e1", SamplingParams(max_tokens=1), 5, np.arange(5, dtype=np.int32), "last")
    assert roundtrip(new).pooling == "last"
    with pytest.raises(ProtocolError):
        SubmitRequest("e2", np.arange(5, dtype=np.int32), SamplingParams(), pooling="max")


def test_pooled_states_must_match_their_ids():
    with pytest.raises(ProtocolError):
        StepResult(step_id=1, worker_id=0, request_ids=[], num_sampled=np.zeros(0, np.int32),
                   sampled_token_ids=np.zeros(0, np.int32), pooled_request_ids=["e1"],
                   pooled_states=STATES)
