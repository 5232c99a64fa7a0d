"""Clients of a module's served `pool` fixture (each e2e module starts its own server): the
official openai and anthropic clients, and the served model's id."""
from __future__ import annotations

import anthropic
import openai
import pytest


@pytest.fixture(scope="module")
def oai(pool):
    return openai.OpenAI(base_url=f"{pool.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(pool):
    return anthropic.Anthropic(base_url=pool.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(oai):
    return oai.models.list().data[0].id
