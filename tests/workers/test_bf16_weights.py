"""`--weights bf16`: bf16 matmuls on the CPU (oneDNN), everything between them fp32.

Checked against the independent dense reference (tests/support/reference_llama.py) with a tolerance
that bf16 rounding meets and a wrong weight or layout would not; the fallback to fp32 where the
CPU has no bf16 instructions; and the kernel really being bf16 (not silently fp32)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tests.support.reference_llama import ReferenceLlama
from workers.engine import LLMEngine
from workers.model.forward import Linear, has_onednn_bf16
from workers.weights import paths as weight_paths
from workers.weights.paths import WeightPaths, load_model

SPEC = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=384, context=256, type="Q4_1")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

needs_onednn_bf16 = pytest.mark.skipif(not has_onednn_bf16(), reason="oneDNN has no bf16 kernels here")


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Take the bf16 path whether or not this CPU multiplies bf16 in hardware (oneDNN emulates
    it on AVX-512 CPUs without it: slower, same numbers)."""
    monkeypatch.setattr(weight_paths, "has_hardware_bf16", lambda: True)


@needs_onednn_bf16
def test_linear_keeps_bf16_weights_and_answers_in_the_input_dtype():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(5, 64)
    linear = Linear(weight, torch.bfloat16)
    assert linear.is_onednn and linear.weight.dtype == torch.bfloat16
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (5, 96)
    exact = x.double() @ weight.double().T
    rounded = x.bfloat16().double() @ weight.bfloat16().double().T  # what bf16 inputs give, exactly
    # accumulated in fp32, then rounded to bf16 once (8 significant bits: half an ulp is 2^-9)
    assert ((out.double() - rounded).abs() <= rounded.abs() * 2**-8 + 1e-4).all()
    assert (out.double() - exact).abs().max() > 1e-6  # it did round: not the fp32 kernel
    for rows in (1, 17, 70):  # row buckets pad to oneDNN's shapes and come back trimmed
        y = torch.randn(rows, 64)
        assert torch.allclose(linear(y), Linear(weight, torch.bfloat16)(y))
        assert linear(y).shape == (rows, 96)


@needs_onednn_bf16
def test_bf16_model_matches_the_reference_within_bf16_rounding(tiny_gguf, bf16_cpu):
    path = tiny_gguf(**SPEC)
    model = load_model(GGUFFile(path), weights="bf16", progress=False)
    assert model.layers[0].qkv.weight.dtype == torch.bfloat16
    assert model.output.weight.dtype == torch.bfloat16
    assert model.token_embd.dtype == torch.float32  # lookups and norms stay fp32
    prompt = list(range(7, 57))
    engine = LLMEngine(path, weights="bf16", progress=False, num_blocks=32)
    plan = StepPlan.build(1, [("a", 0, prompt, list(range(4)), True)],
                          [NewRequest("a", GREEDY, len(prompt), np.asarray(prompt, np.int32))],)
    got = engine.runner.forward_logits(plan)[0]
    reference = ReferenceLlama(path).forward(prompt)[-1]
    spread = reference.std()
    error = (got - reference).abs().max()
    assert error < 0.05 * spread, (float(error), float(spread))
    assert error > 1e-5 * spread  # bf16 did change the numbers
    assert int(got.argmax()) == int(reference.argmax())
    fp32 = LLMEngine(path, weights="fp32", progress=False, num_blocks=32)
    outs = [e.generate([prompt], GREEDY)[0].token_ids for e in (engine, fp32)]
    assert outs[0][:2] == outs[1][:2]
    engine.close()
    fp32.close()


def test_bf16_runs_fp32_with_a_warning_where_the_cpu_lacks_bf16(monkeypatch, caplog, tiny_gguf):
    monkeypatch.setattr(weight_paths, "has_hardware_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="workers.weights.paths"):
        paths = WeightPaths("bf16", "cpu")
    assert paths.mode == "fp32"
    assert "no bf16 matmul instructions" in caplog.text
    model = load_model(GGUFFile(tiny_gguf(**SPEC)), weights="bf16", progress=False)
    assert model.layers[0].qkv.weight.dtype == torch.float32
    assert WeightPaths("bf16", "cpu").keeps_quantized is False  # dense only: no 4-bit copies


def test_bf16_on_cuda_is_the_dense_path():
    """The GPU forward already computes in bf16: the mode changes nothing there (deciding it
    needs no device)."""
    assert WeightPaths("bf16", "cuda").mode == "fp32"
