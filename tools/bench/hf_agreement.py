"""Greedy agreement with HF transformers on tiny random models converted by llama.cpp's own
converter, per KV cache dtype (and, with --llama-server, llama-server's defaults on the same
files): how often each setting gives transformers' greedy tokens.

For each architecture a tiny fp32 HF model (tests/support/hf_gguf.py) is saved and converted
to an F32 GGUF by convert_hf_to_gguf.py (tests/support/llama_convert.py, the llama-cpp-python
sdist fetched once into a cache); PROMPTS random prompts each get --tokens greedy tokens from
transformers (a full forward per token) and from `LLMEngine` with the default weights (auto)
and each KV cache dtype. A file counts as agreeing when every prompt's tokens are
transformers'. Tiny random models have close logits, so a KV cache that rounds K/V coarsely
flips their argmax where a more exact one does not: this is the comparison behind the
default `--kv-cache-dtype` (docs/runtime.md).

    python -m tools.bench hf-agreement [--kv-cache-dtypes float32,bfloat16,float16]
        [--llama-server PATH/llama-server] [--tokens 24] [--prompts 6]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from justapi.sampling import SamplingParams

BIG_WINDOW = 4096
"""Sliding windows longer than any prompt here: the converters write them, and none masks a key."""
CASES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=BIG_WINDOW),
    "qwen2": dict(model_type="qwen2"),
    "qwen2moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                     shared_expert_intermediate_size=64),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "qwen3moe": dict(model_type="qwen3_moe", head_dim=24, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=48, norm_topk_prob=True),
    "gemma2": dict(model_type="gemma2", head_dim=24, query_pre_attn_scalar=24, sliding_window=BIG_WINDOW),
    "gemma3": dict(model_type="gemma3_text", head_dim=24, query_pre_attn_scalar=24, sliding_window=BIG_WINDOW),
    "phi3": dict(model_type="phi3", sliding_window=BIG_WINDOW),
}
"""The tiny models (tests/workers/test_architectures.py's shapes; windows that mask nothing: this
compares the KV cache, not sliding windows). Qwen3-MoE normalizes its top-k routing weights, as
the published models say (`norm_topk_prob: true`) and as llama.cpp reads every qwen3moe GGUF (the
converter writes no key for it); transformers' config default is false."""
TOKENIZERS = {"qwen2moe": "bpe", "qwen3moe": "bpe"}
VOCAB = 640
"""Room for the converter's tokenizers (the SentencePiece one has 600 pieces)."""
"""Converters that read only byte-level BPE vocabularies (llama_convert.save_hf_model)."""


def convert_models(work: Path, cases: list[str]) -> dict[str, tuple[Any, Path]]:
    """case -> (the HF model, its GGUF made by llama.cpp's converter)."""
    from tests.support.hf_gguf import tiny_hf_model
    from tests.support.llama_convert import convert_all, save_hf_model

    models, jobs = {}, []
    for i, case in enumerate(cases):
        fields = dict(CASES[case])
        hf = tiny_hf_model(fields.pop("model_type"), seed=i, vocab_size=VOCAB, **fields)
        directory = save_hf_model(hf, work / case, TOKENIZERS.get(case, "spm"))
        models[case] = hf
        jobs.append((directory, work / f"{case}.gguf", "f32"))
    convert_all(jobs)
    return {case: (models[case], work / f"{case}.gguf") for case in cases}


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(8, 41))).tolist() for _ in range(count)]


def ours(path: Path, kv_dtype: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from workers.engine import LLMEngine

    engine = LLMEngine(str(path), progress=False, weights="auto", kv_cache_dtype=kv_dtype, max_seqs=len(prompts))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return [out.token_ids for out in engine.generate(prompts, params)]
    finally:
        engine.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def llama_server(binary: str, path: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """llama-server with its defaults (f16 KV cache) on the file: greedy tokens per prompt."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([binary, "-m", str(path), "--port", str(port), "-t", "2", "-np", "1"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                log.seek(0)
                lines = [line for line in log.read().decode(errors="replace").splitlines() if "error" in line.lower()]
                raise RuntimeError(f"llama-server exited ({server.returncode}): {lines[-1] if lines else ''}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        out = []
        for prompt in prompts:
            body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                               "cache_prompt": False, "return_tokens": True}).encode()
            request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                out.append(json.loads(reply.read())["tokens"])
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench hf-agreement", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--kv-cache-dtypes", default="float32,bfloat16,float16,auto")
    parser.add_argument("--llama-server", default="", help="a llama-server binary to compare as well")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args(argv)
    from tests.support.hf_gguf import hf_greedy

    settings = args.kv_cache_dtypes.split(",") + (["llama-server"] if args.llama_server else [])
    agree_files = {s: 0 for s in settings}
    agree_prompts = {s: 0 for s in settings}
    with tempfile.TemporaryDirectory() as work:
        models = convert_models(Path(work), args.cases.split(","))
        for case, (hf, path) in models.items():
            prompts = prompts_for(hf.config.vocab_size, args.prompts, seed=len(case))
            want = [hf_greedy(hf, p, args.tokens) for p in prompts]
            line = []
            for setting in settings:
                try:
                    got = (llama_server(args.llama_server, path, prompts, args.tokens) if setting == "llama-server"
                           else ours(path, setting, prompts, args.tokens))
                except (RuntimeError, ValueError, OSError) as exc:  # the file refused: counts as no agreement
                    line.append(f"{setting} error ({' '.join(str(exc).split())[:160]})")
                    continue
                same = sum(g == w for g, w in zip(got, want))
                agree_prompts[setting] += same
                agree_files[setting] += same == len(prompts)
                line.append(f"{setting} {same}/{len(prompts)}")
            print(f"{case:>9}: " + ", ".join(line), flush=True)
    total = len(models) * args.prompts
    print(f"files where every prompt gives transformers' {args.tokens} greedy tokens (of {len(models)}): "
          + ", ".join(f"{s} {agree_files[s]} ({agree_prompts[s]}/{total} prompts)" for s in settings))
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
