"""Sampling fields a request leaves out take the server's defaults (config, else the GGUF's
general.sampling.*, else llama-server's), over HTTP and over ZMQ; a request's own values win,
temperature 0 and top_p 1 included; /v1/models says which defaults are in force."""
from __future__ import annotations

import asyncio
import types
from contextlib import asynccontextmanager
from pathlib import Path

import gguf
import pytest

from justapi.client import AsyncClient, make_submit
from justapi.frontend.openai_models import ModelList
from justapi.frontend.server import FrontendSettings, build_serving
from justapi.frontend.zmq_server import ZmqServer
from justapi.model.gguf_file import GGUFFile
from justapi.model.info import GGUF_SAMPLING_KEYS, model_sampling_defaults
from justapi.sampling import BUILTIN_SAMPLING_DEFAULTS, SamplingDefaults, SamplingParams
from justapi.wire import transport
from tests.support.api_stack import MODEL, run, serving_stack, smollm_gguf
from tests.support.gguf_tokenizers import copy_tokenizer_gguf

LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                "repetition_penalty": 1.0}
DEFAULTED = tuple(LLAMA_SERVER)


def _picked(sampling: SamplingParams) -> dict:
    return {name: getattr(sampling, name) for name in DEFAULTED}


def _gguf_with(tmp_path: Path, **metadata: object) -> GGUFFile:
    path = copy_tokenizer_gguf(tmp_path / "m.gguf", smollm_gguf(), metadata)
    return GGUFFile(str(path))


def test_builtin_defaults_are_llama_servers():
    assert BUILTIN_SAMPLING_DEFAULTS == LLAMA_SERVER
    assert SamplingDefaults.resolve().values == LLAMA_SERVER
    assert set(SamplingDefaults.resolve().sources.values()) == {"builtin"}


def test_the_gguf_keys_are_llama_cpps():
    keys = gguf.Keys.General
    assert GGUF_SAMPLING_KEYS == {
        "temperature": keys.SAMPLING_TEMP, "top_k": keys.SAMPLING_TOP_K,
        "top_p": keys.SAMPLING_TOP_P, "min_p": keys.SAMPLING_MIN_P,
        "repetition_penalty": keys.SAMPLING_PENALTY_REPEAT}


def test_the_models_defaults_are_read_from_its_gguf(tmp_path):
    model = _gguf_with(tmp_path, **{"general.sampling.temp": 0.7, "general.sampling.top_k": 20,
                                    "general.sampling.top_p": 1.5})  # top_p out of range
    assert model_sampling_defaults(model) == {"temperature": 0.7, "top_k": 20}
    assert model_sampling_defaults(smollm_gguf()) == {}  # SmolLM2 carries none


def test_config_then_model_then_builtin():
    defaults = SamplingDefaults.resolve({"top_k": 5}, {"top_k": 20, "temperature": 0.7})
    assert defaults.values == {**LLAMA_SERVER, "top_k": 5, "temperature": 0.7}
    assert defaults.sources == {"temperature": "gguf", "top_k": "config", "top_p": "builtin",
                                "min_p": "builtin", "repetition_penalty": "builtin"}
    assert defaults.describe().startswith("temperature 0.7 (gguf), top-k 5 (config), top-p 0.95")


def test_the_frontend_resolves_flags_over_the_gguf(tmp_path):
    model = _gguf_with(tmp_path, **{"general.sampling.temp": 0.6, "general.sampling.min_p": 0.1})
    settings = FrontendSettings("ipc://unused-in", "ipc://unused-out", "ipc://unused-client",
                                sampling_defaults={"min_p": 0.0, "top_p": 0.9})
    serving = build_serving(model, types.SimpleNamespace(stats=None), settings)
    defaults = serving.config.sampling_defaults
    assert defaults.values == {**LLAMA_SERVER, "temperature": 0.6, "min_p": 0.0, "top_p": 0.9}
    assert (defaults.sources["temperature"], defaults.sources["min_p"]) == ("gguf", "config")


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_http_fields_left_out_take_the_defaults_and_given_ones_win(route, body):
    defaults = SamplingDefaults.resolve({"top_k": 7}, {"temperature": 0.6})

    async def scenario():
        async with serving_stack(sampling_defaults=defaults) as stack:
            await stack.http.post(route, json={**body, "max_tokens": 2})
            await stack.http.post(route, json={**body, "max_tokens": 2, "temperature": 0,
                                               "top_p": 1, "top_k": 0, "min_p": 0})
            omitted, given = (_picked(r.sampling) for r in stack.fake.submitted)
            assert omitted == {**LLAMA_SERVER, "temperature": 0.6, "top_k": 7}
            assert given == {"temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0,
                             "repetition_penalty": 1.0}
            assert stack.fake.submitted[1].sampling.is_greedy
    run(scenario)


def test_models_lists_the_defaults_and_where_they_come_from():
    defaults = SamplingDefaults.resolve({"top_k": 7}, {"temperature": 0.6})

    async def scenario():
        async with serving_stack(sampling_defaults=defaults) as stack:
            data = (await stack.http.get("/v1/models")).json()
            ModelList.model_validate(data)
            card = data["data"][0]
            assert card["id"] == MODEL
            assert card["sampling_defaults"] == {
                **LLAMA_SERVER, "temperature": 0.6, "top_k": 7,
                "source": {"temperature": "gguf", "top_k": "config", "top_p": "builtin",
                           "min_p": "builtin", "repetition_penalty": "builtin"}}
    run(scenario)


def test_the_client_names_the_fields_it_left_out():
    assert make_submit("x", None, None, {"temperature": 0}).unset_sampling == \
        ["top_k", "top_p", "min_p", "repetition_penalty"]
    assert make_submit("x", None, SamplingParams(), {}).unset_sampling == []


@asynccontextmanager
async def _zmq(defaults: SamplingDefaults):
    async with serving_stack(sampling_defaults=defaults) as stack:
        server = ZmqServer(stack.serving, transport.ipc_endpoint(stack.runtime_dir, "client"))
        task = asyncio.ensure_future(server.run())
        try:
            async with AsyncClient(server.endpoint) as client:
                yield stack, client
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_zmq_fields_left_out_take_the_defaults_and_given_ones_win():
    defaults = SamplingDefaults.resolve({"min_p": 0.2})

    async def scenario():
        async with _zmq(defaults) as (stack, client):
            await client.complete("hi", max_tokens=2)
            await client.complete("hi", max_tokens=2, temperature=0, top_p=1.0)
            await client.complete("hi", sampling=SamplingParams(max_tokens=2))
            omitted, given, whole = (_picked(r.sampling) for r in stack.fake.submitted)
            assert omitted == {**LLAMA_SERVER, "min_p": 0.2}
            assert given == {**LLAMA_SERVER, "min_p": 0.2, "temperature": 0, "top_p": 1.0}
            assert whole == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                             "repetition_penalty": 1.0}  # a whole SamplingParams: as sent
    run(scenario)
