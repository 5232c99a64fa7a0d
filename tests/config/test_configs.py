"""Every TOML in configs/ loads into a valid ServeConfig, and config files with an unknown key
or a bad value are refused naming the key."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from justapi.config.sections import ConfigError
from justapi.config.serve import build_config, key_map, load_toml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def load(path: Path):
    return build_config(load_toml(str(path)), {})


def test_there_is_a_config_for_each_way_to_run():
    names = {p.stem for p in CONFIGS}
    assert {"cpu", "cpu-workers", "pd", "spec-ngram", "spec-draft", "gpu"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path: Path):
    """Every key of the file lands in its field; every other field keeps its default, but for
    what a key implies (`pd` the worker count, `draft-model` the proposer)."""
    config = load(path)
    values = {key.replace("_", "-"): value for key, value in load_toml(str(path)).items()}
    assert values, f"{path.name} sets nothing"
    implied = {"workers": config.pd.num_workers} if "pd" in values else {}
    implied |= {"spec": "draft"} if "draft-model" in values else {}
    defaults = build_config({}, {})
    for key, (section, field) in key_map().items():
        loaded = getattr(getattr(config, section), field.name)
        default = getattr(getattr(defaults, section), field.name)
        assert loaded == values.get(key, implied.get(key, default)), key


def test_what_each_config_sets():
    by_name = {p.stem: p for p in CONFIGS}
    cpu = load(by_name["cpu"])
    assert cpu.server.workers == 1 and cpu.model.model == "" and cpu.scheduler.scheduled
    workers = load(by_name["cpu-workers"])
    assert workers.server.workers == 2 and workers.ops.restart_workers
    gpu = load(by_name["gpu"])
    assert gpu.model.device == "cuda" and gpu.cache.pool_blocks > 0 and gpu.ops.restart_workers


def test_spec_configs_turn_speculation_on():
    by_name = {p.stem: p for p in CONFIGS}
    ngram = load(by_name["spec-ngram"]).speculative
    assert ngram.spec == "ngram" and ngram.gamma == 7
    draft = load(by_name["spec-draft"]).speculative
    assert draft.spec == "draft" and draft.draft_model == "models/draft.gguf" and draft.gamma == 4


def test_pd_config_sets_one_prefill_and_one_decode_worker():
    pd = load(next(p for p in CONFIGS if p.stem == "pd"))
    assert pd.pd.pd == "1:1" and pd.server.workers == 2


def test_flags_override_the_file():
    path = next(p for p in CONFIGS if p.stem == "cpu-workers")
    config = build_config(load_toml(str(path)), {"workers": 3, "restart_workers": False})
    assert config.server.workers == 3 and not config.ops.restart_workers


@pytest.mark.parametrize("text,message", [
    ("wrokers = 2\n", "unknown config key 'wrokers'"),
    ("max-seqs = 0\n", "max-seqs must be a positive integer, got 0"),
    ("restart-workers = \"yes\"\n", "restart-workers must be true or false, got 'yes'"),
    ("step-timeout-s = 0\n", "step-timeout-s must be a number >= 1, got 0"),
    ("admin = \"tcp://0.0.0.0:7000\"\n", "admin must be ipc:// or a loopback tcp:// address"),
    ("device = \"tpu\"\n", "device must be one of ('cpu', 'cuda'), got 'tpu'"),
    ("block-size = 12\n", "block-size must be a power of two"),
    ("[server]\nworkers = 2\n", "keys must be flat (flag names), found table(s) ['server']"),
    ("workers = \n", "is not valid TOML"),
])
def test_bad_config_files_name_the_key(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config(load_toml(str(path)), {})
