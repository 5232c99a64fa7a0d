"""The checks every config section shares: check_number's ranges and messages (naming the key
in its flag spelling), and the sampling-defaults section's keys and ranges."""
from __future__ import annotations

import re

import pytest

from justapi.config.fields import ConfigError, check_number
from justapi.config.serve import build_config


@pytest.mark.parametrize("value, bounds", [
    (1, dict(low=1, integer=True)),
    (7, dict(low=0, high=7, integer=True)),
    (0.5, dict(above=0.0, high=1.0)),
    (1, dict(low=1.0)),  # an int is a number
    (-1, dict(low=-1, high=10**9, integer=True)),
    (3.0, dict(high=3.0)),
])
def test_numbers_in_range_pass(value, bounds):
    check_number(value, "key", **bounds)


@pytest.mark.parametrize("value, bounds, message", [
    (0, dict(low=1, integer=True), "max-seqs must be a positive integer, got 0"),
    (1.5, dict(low=1, integer=True), "max-seqs must be a positive integer, got 1.5"),
    (True, dict(low=1, integer=True), "max-seqs must be a positive integer, got True"),
    (-1, dict(low=0, integer=True), "max-seqs must be an integer >= 0, got -1"),
    (33, dict(low=1, high=32, integer=True), "max-seqs must be an integer in [1, 32], got 33"),
    (0, dict(low=1.0), "max-seqs must be a number >= 1, got 0"),
    (0.55, dict(low=0.6), "max-seqs must be a number >= 0.6, got 0.55"),
    (0, dict(above=0.0), "max-seqs must be a number > 0, got 0"),
    (0.0, dict(above=0.0, high=0.95), "max-seqs must be a number in (0, 0.95], got 0.0"),
    (2e6, dict(low=0.0, high=1e6), "max-seqs must be a number in [0, 1e+06], got 2000000.0"),
    ("2", dict(low=0, high=1024, integer=True), "max-seqs must be an integer in [0, 1024], got '2'"),
    (None, dict(high=3.0), "max-seqs must be a number <= 3, got None"),
])
def test_numbers_out_of_range_name_the_key_and_the_range(value, bounds, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_number(value, "max-seqs", **bounds)


def test_sampling_default_keys_load_and_default_to_unset():
    config = build_config({"temperature": 0.2, "top-k": 20}, {"top_p": 0.5})
    assert config.sampling.given() == {"temperature": 0.2, "top_k": 20, "top_p": 0.5}
    assert build_config({}, {}).sampling.given() == {}


@pytest.mark.parametrize("values, message", [
    ({"temperature": -1}, "temperature must be in [0, 100], got -1"),
    ({"top-p": 0}, "top-p must be in (0, 1], got 0"),
    ({"top-k": 2.5}, "top-k must be an integer"),
    ({"min-p": 2}, "min-p must be in [0, 1], got 2"),
    ({"repetition-penalty": 0}, "repetition-penalty must be in (0, 10], got 0"),
])
def test_bad_sampling_defaults_name_the_key(values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config(values, {})
