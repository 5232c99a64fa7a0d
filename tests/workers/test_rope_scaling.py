"""Rope scaling read from GGUF metadata (workers/weights/hparams.py) and its tables
(workers/model/rotary.py), without a converter: the refusals name what is wrong, and which
LongRoPE rows take the long table. (Files from llama.cpp's converter, against transformers:
test_converted_models.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFError, GGUFFile
from tests.support.gguf_tokenizers import OverriddenGGUF
from tests.support.hf_gguf import tiny_hf_model, write_gguf
from workers.model.rotary import Rotary, long_rope_rows
from workers.weights.hparams import NO_SCALING, RopeScaling, read_hyper_params

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> GGUFFile:
    return GGUFFile(write_gguf(tiny_hf_model("qwen2"), str(tmp_path_factory.mktemp("rope") / "q.gguf")))


def test_yarn_is_read_with_llama_cpps_defaults(qwen2):
    p = read_hyper_params(OverriddenGGUF(qwen2, {"qwen2.rope.scaling.type": "yarn",
                                                 "qwen2.rope.scaling.factor": 4.0,
                                                 "qwen2.rope.scaling.original_context_length": 64}))
    assert p.rope_scale == 1.0
    assert p.rope_scaling == RopeScaling("yarn", 4.0, 64, 0.1 * float(np.log(4.0)) + 1.0)


@pytest.mark.parametrize("overrides,message", [
    ({"qwen2.rope.scaling.type": "ntk"}, "unsupported rope scaling type 'ntk' (supported: none, linear, yarn, longrope)"),
    ({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 0.5}, "yarn rope scaling factor 0.5"),
    ({"qwen2.rope.scaling.type": "longrope"}, "'longrope' without its factor tables"),
    ({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 2.0,
      "qwen2.rope.scaling.yarn_ext_factor": 3.0}, "yarn_ext_factor 3.0 is not in [0, 1]"),
])
def test_bad_rope_scaling_is_refused_naming_it(qwen2, overrides, message):
    with pytest.raises(GGUFError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_hyper_params(OverriddenGGUF(qwen2, overrides))


def test_one_longrope_table_alone_is_refused(tmp_path):
    path = write_gguf(tiny_hf_model("phi3"), str(tmp_path / "p.gguf"),
                      extra_tensors={"rope_factors_long.weight": np.ones(8)})
    with pytest.raises(GGUFError, match="LongRoPE needs both 'rope_factors_long.weight' and "
                                        "'rope_factors_short.weight'"):
        read_hyper_params(GGUFFile(path))


def test_longrope_rows_take_the_long_table_by_sequence_length():
    scaling = RopeScaling("longrope", original_context=8)
    positions = np.array([0, 1, 2, 3, 9, 4, 5, 6, 7])  # a: 4-token prefill, b: decode, c: 4 rows
    num_tokens = np.array([4, 1, 4])
    assert long_rope_rows(scaling, positions, num_tokens, np.array([4, 10, 12])).tolist() == \
        [False] * 4 + [True] * 5  # b and c are longer than 8: c's early rows too
    assert long_rope_rows(scaling, positions, num_tokens, np.array([4, 9, 8])) is None  # positions decide
    assert long_rope_rows(NO_SCALING, positions, num_tokens, np.array([40, 40, 40])) is None
    short, long = torch.full((4,), 1.0), torch.full((4,), 2.0)
    rotary = Rotary(8, 10000.0, scaling=scaling, long_factors=(short, long))
    cos, _ = rotary.tables(torch.tensor([3, 3, 8]), torch.float32, torch.tensor([False, True, False]))
    plain = Rotary(8, 10000.0)
    assert torch.equal(cos[0], plain.tables(torch.tensor([3]), torch.float32)[0][0])  # short: factors 1
    assert torch.allclose(cos[1], plain.tables(torch.tensor([1.5]), torch.float32)[0][0])  # long: / 2
    assert torch.allclose(cos[2], plain.tables(torch.tensor([4.0]), torch.float32)[0][0])  # position 8 > 7
