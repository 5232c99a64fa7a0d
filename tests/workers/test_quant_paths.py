"""`--weights fp32|bf16|q4|auto` through the runtime: auto's per-step choice in both directions
inside one run (calls per path counted), the q4 path's outputs against fp32 on a tiny model, the
flag through `justapi generate`, the serve config and a served worker, and perplexity windows."""
from __future__ import annotations

import json
import signal

import numpy as np
import openai
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType

from justapi.cli import main as cli_main
from justapi.config.serve import build_config
from justapi.model.gguf_file import GGUFFile
from justapi.sampling import SamplingParams
from justapi.wire.protocol import NewRequest, StepPlan
from tests.support.reference_llama import ReferenceLlama
from workers.engine import LLMEngine
from workers.kv.pool import KVPool, PoolShape
from workers.model.attention import TorchCpuBackend
from workers.model.perplexity import perplexity, window_starts
from workers.runner import ModelRunner
from workers.weights.block_linear import BlockLinear
from workers.weights.path_plan import PathPlan
from workers.weights import paths as paths_module
from workers.weights.paths import has_hardware_bf16, load_model
from workers.weights.quant_linear import Int4Linear

SPEC = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=384, context=256,
            type="Q4_1", embed_type="Q8_0")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def layer_linears(model) -> list[BlockLinear]:
    return [lin for layer in model.layers for lin in layer.linears()]


def calls(linears: list[BlockLinear], path: str) -> int:
    return sum(linear.num_calls[path] for linear in linears)


def test_auto_takes_the_block_kernel_for_small_steps_and_dense_tiles_for_large_ones(tiny_gguf):
    plan = PathPlan(((8, "int8"), (1 << 16, "dense")))
    model = load_model(GGUFFile(tiny_gguf(**SPEC)), weights="auto", progress=False, plan=plan)
    linears, head = layer_linears(model), model.output
    assert all(isinstance(lin, BlockLinear) for lin in linears) and isinstance(head, BlockLinear)
    p = model.params
    pool = KVPool.create(PoolShape(p.num_layers, 64, 16, p.num_kv_heads, p.head_dim))
    runner = ModelRunner(model, pool, TorchCpuBackend(16))
    prompt = list(range(3, 3 + 8 + 8))  # one step of more rows than the plan's small range
    new = NewRequest("a", GREEDY, len(prompt), np.asarray(prompt, np.int32))
    first = runner.execute(StepPlan.build(1, [("a", 0, prompt, list(range(8)), True)], [new]))
    assert (calls(linears, "int8"), calls(linears, "dense")) == (0, len(linears))  # prefill: tiles
    assert (head.num_calls["int8"], head.num_calls["dense"]) == (1, 0)  # one sampled row
    token = int(first.sampled_token_ids[0])
    runner.execute(StepPlan.build(2, [("a", len(prompt), [token], list(range(8)), True)]))
    assert (calls(linears, "int8"), calls(linears, "dense")) == (len(linears), len(linears))  # decode
    assert (head.num_calls["int8"], head.num_calls["dense"]) == (2, 0)
    pool.close()


def test_q4_path_stays_close_to_fp32(tiny_gguf):
    """Same tiny model: the int4 path's logits differ from fp32 only by bf16 rounding."""
    path = tiny_gguf(**SPEC)
    engines = {mode: LLMEngine(path, weights=mode, progress=False, num_blocks=32) for mode in ("fp32", "q4")}
    assert isinstance(engines["q4"].model.layers[0].qkv, Int4Linear)
    prompt = list(range(10, 40))
    logits = {}
    for mode, engine in engines.items():
        plan = StepPlan.build(1, [("a", 0, prompt, list(range(4)), True)],
                              [NewRequest("a", GREEDY, len(prompt), np.asarray(prompt, np.int32))])
        logits[mode] = engine.runner.forward_logits(plan)[0]
    spread = logits["fp32"].std()
    assert (logits["q4"] - logits["fp32"]).abs().max() < 0.05 * spread
    assert not torch.equal(logits["q4"], logits["fp32"])  # it did take another kernel
    outs = {mode: engine.generate([prompt], GREEDY)[0].token_ids for mode, engine in engines.items()}
    assert outs["q4"][:2] == outs["fp32"][:2]
    for engine in engines.values():
        engine.close()


def test_generate_cli_takes_the_weights_flag(tiny_gguf):
    path = tiny_gguf(**SPEC)
    args = ["generate", "--model", path, "--prompt", "hello there", "--max-tokens", "6",
            "--ignore-eos", "--json"]
    q4 = CliRunner().invoke(cli_main, [*args, "--weights", "q4"])
    assert q4.exit_code == 0, q4.output
    engine = LLMEngine(path, weights="q4", progress=False, max_seqs=1)
    expected = engine.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert json.loads(q4.output)["token_ids"] == expected[0].token_ids
    bad = CliRunner().invoke(cli_main, [*args, "--weights", "int4"])
    assert bad.exit_code != 0 and "int4" in bad.output


def test_serve_flag_reaches_the_model_config():
    assert build_config({}, {}).model.weights == "auto"  # the default
    assert build_config({}, {"weights": "fp32"}).model.weights == "fp32"
    assert build_config({"weights": "q4"}, {}).model.weights == "q4"
    with pytest.raises(ValueError, match="weights must be one of"):
        build_config({}, {"weights": "int8"})
    from justapi.launch.serve import serve
    assert "--weights [fp32|bf16|q4|auto]" in CliRunner().invoke(serve, ["--help"]).output


def test_auto_runs_fp32_on_a_cpu_without_the_int8_kernels(monkeypatch):
    """Without AVX2 the block kernels have no int8 panels or direct path: auto (the default)
    then holds and multiplies fp32, the fastest path there; a forced plan still gets blocks."""
    kernels = paths_module.block_kernels()
    if kernels is None:
        pytest.skip("no C compiler: auto runs fp32 anyway")
    assert paths_module.WeightPaths("auto").mode == ("auto" if kernels.has_panels else "fp32")
    monkeypatch.setattr(kernels, "has_panels", False)
    fallback = paths_module.WeightPaths("auto")
    assert fallback.mode == "fp32" and fallback.form(GGMLQuantizationType.Q4_1) == "dense"
    forced = paths_module.WeightPaths("auto", plan=PathPlan.only("int8"))
    assert forced.mode == "auto" and forced.form(GGMLQuantizationType.Q4_1) == "blocks"


def test_perplexity_windows_and_score(tiny_gguf):
    assert window_starts(10, 4, 2) == [0, 2, 4, 6]
    assert window_starts(11, 4, 4) == [0, 4]
    with pytest.raises(ValueError, match="fewer than one window"):
        window_starts(3, 4, 2)
    engine = LLMEngine(tiny_gguf(**SPEC), progress=False, num_blocks=32)
    ids = list(range(5, 133))
    whole = perplexity(engine, ids, n_ctx=64)
    chunked = perplexity(engine, ids, n_ctx=64, chunk_rows=7)
    assert (whole.num_windows, whole.num_scored) == (3, 96)
    assert whole.perplexity == pytest.approx(chunked.perplexity, rel=1e-4)  # chunked prefill agrees
    # against the dense reference forward: NLL of tokens [32, 64) of one 64-token window
    reference = ReferenceLlama(tiny_gguf(**SPEC)).forward(ids[:64]).double().log_softmax(-1)
    nll = -reference[31:63].gather(1, torch.tensor(ids[32:64])[:, None]).mean()
    assert perplexity(engine, ids[:64], n_ctx=64).mean_nll == pytest.approx(float(nll), rel=1e-4)
    engine.close()


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["q4", "bf16"])
def test_served_worker_runs_the_weights_it_was_given(tiny_gguf, mode):
    """`justapi serve --weights q4|bf16`: the served logprobs are that engine's, not fp32's
    (bf16 on a CPU without bf16 instructions runs fp32: then both are fp32's)."""
    from tools.harness import ServedPool

    path = tiny_gguf(**SPEC)
    prompt = [10, 11, 12, 13, 14, 15]
    expected = {}
    for mode_run in ("fp32", mode):
        engine = LLMEngine(path, weights=mode_run, progress=False, num_blocks=32,
                           kv_cache_dtype="auto")  # serve's default cache (bf16)
        plan = StepPlan.build(1, [("a", 0, prompt, list(range(4)), True)],
                              [NewRequest("a", GREEDY, len(prompt), np.asarray(prompt, np.int32))])
        expected[mode_run] = torch.log_softmax(engine.runner.forward_logits(plan)[0], -1).max().item()
        engine.close()
    is_distinct = mode == "q4" or has_hardware_bf16()
    assert (abs(expected[mode] - expected["fp32"]) > 1e-5) == is_distinct
    served = ServedPool("--model", path, "--weights", mode, "--pool-blocks", "64")
    try:
        oai = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)
        out = oai.completions.create(model=oai.models.list().data[0].id, prompt=prompt, max_tokens=1,
                                     temperature=0, logprobs=1)
        got = out.choices[0].logprobs.token_logprobs[0]
        assert abs(got - expected[mode]) < 1e-6
        assert (abs(got - expected["fp32"]) > 1e-6) == is_distinct
    finally:
        assert served.stop(signal.SIGTERM) == 0, served.log()
