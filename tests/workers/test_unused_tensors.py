"""Every tensor of a GGUF is read by the loader or the file is refused in one line naming the
ones left over (a norm, bias or scaling table of a variant the model code does not know would
otherwise be ignored and the model misread); `--allow-unused-tensors` loads it with a warning."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from click.testing import CliRunner

from justapi.cli import main
from justapi.model.gguf_file import GGUFError, GGUFFile
from tests.support.hf_gguf import tiny_hf_model, write_gguf
from workers.weights.gguf_loader import load_weights

pytest.importorskip("transformers")

EXTRA = {"blk.1.attn_q_norm.weight": np.ones(16), "blk.0.attn_sinks.weight": np.zeros(4)}
"""A per-head q norm on a llama file (Qwen3 has them, llama not) and gpt-oss' attention sinks."""


@pytest.fixture(scope="module")
def extra_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("unused") / "llama-extra.gguf")
    return write_gguf(tiny_hf_model("llama"), path, extra_tensors=EXTRA)


def test_a_file_with_tensors_the_loader_does_not_read_is_refused_naming_them(extra_path):
    with pytest.raises(GGUFError) as info:
        load_weights(GGUFFile(extra_path), progress=False)
    message = str(info.value)
    assert "\n" not in message and extra_path in message
    assert "2 tensors the llama loader does not use: 'blk.1.attn_q_norm.weight', " \
           "'blk.0.attn_sinks.weight'" in message
    assert "--allow-unused-tensors" in message


def test_allow_unused_tensors_loads_it_and_names_them_in_a_warning(extra_path, caplog):
    with caplog.at_level(logging.WARNING, logger="workers.weights.gguf_loader"):
        weights = load_weights(GGUFFile(extra_path), progress=False, allow_unused_tensors=True)
    assert weights.params.num_layers == 2
    assert "'blk.1.attn_q_norm.weight'" in caplog.text and "--allow-unused-tensors" in caplog.text


def test_generate_refuses_it_in_one_line_and_takes_the_escape_hatch(extra_path):
    args = ["generate", "--model", extra_path, "--prompt", "<t5>", "--max-tokens", "2", "--json"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 1
    assert refused.output.count("\n") == 1 and "'blk.0.attn_sinks.weight'" in refused.output
    loaded = CliRunner().invoke(main, args + ["--allow-unused-tensors"])
    assert loaded.exit_code == 0, loaded.output
