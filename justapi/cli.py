"""The `justapi` command line (click): `justapi generate` runs the in-process engine once;
serve, the ops commands (status, health, drain, flush-cache, keys, inspect, perplexity) and
`bench serve` are registered from their packages.

Bad input (a missing or corrupt GGUF, a prompt longer than the context, no GPU for
--device cuda) ends with exit status 1 and one readable line on stderr, never a traceback.
The data plane (workers.engine, torch) is imported inside the command, so `import justapi`
stays torch-free. Owns: flags and output format. Does not own: generation (workers/engine.py).
"""
from __future__ import annotations

import json
import sys

import click

from justapi.config.sections import KV_CACHE_DTYPES, WEIGHT_MODES
from justapi.sampling import SamplingParams


@click.group()
def main() -> None:
    """JustAPI inference: a small, clear LLM-serving engine."""


@main.command()
@click.option("--model", default="", help="GGUF file, or synthetic:SPEC; default: SmolLM2-135M-Instruct.")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", default=64, show_default=True, type=int, help="Most tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables.")
@click.option("--seed", default=None, type=int, help="Seed for reproducible sampling.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON object {"text", "token_ids", "prompt_token_ids", "finish_reason"}.')
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda[:N]")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@click.option("--weights", default="auto", show_default=True, type=click.Choice(list(WEIGHT_MODES)),
              help="Keep the GGUF blocks with a kernel per step (auto; fp32 on CPUs without "
                   "AVX2 and on GPUs; see docs/quantization.md), dequantize at load (fp32, or "
                   "bf16 matmuls on CPUs that have them) or keep 4-bit planes for the int4 "
                   "kernels (q4).")
@click.option("--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(list(KV_CACHE_DTYPES)),
              help="As justapi serve's: auto (float16 on CPU, bfloat16 on GPU), float16, bfloat16 "
                   "or float32 (the exact cache, CPU only).")
@click.option("--allow-unused-tensors", is_flag=True,
              help="As justapi serve's: load a GGUF holding tensors the loader does not read.")
def generate(model: str, prompt: str, max_tokens: int, temperature: float, top_p: float,
             top_k: int, seed: int | None, chat: bool, as_json: bool, device: str,
             ignore_eos: bool, weights: str, kv_cache_dtype: str, allow_unused_tensors: bool) -> None:
    """Generate a continuation of PROMPT with the in-process engine."""
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        from workers.engine import LLMEngine  # the one place the CLI reaches the data plane

        engine = LLMEngine(model, device=device, max_seqs=1, seed=seed, progress=not as_json,
                           weights=weights, kv_cache_dtype=kv_cache_dtype,
                           allow_unused_tensors=allow_unused_tensors)
        text = engine.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
        output = engine.generate([text], sampling)[0]
        engine.close()
    except (ValueError, RuntimeError, OSError) as exc:
        click.echo(f"error: {_one_line(exc)}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"text": output.text, "token_ids": output.token_ids,
                               "prompt_token_ids": output.prompt_token_ids,
                               "finish_reason": output.finish_reason}))
    else:
        click.echo(output.text)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _register_commands() -> None:
    """`justapi serve`, the ops commands (justapi/ops/) and `justapi bench` (justapi/bench/)."""
    from justapi.bench.command import bench
    from justapi.launch.serve import serve
    from justapi.ops.doctor import doctor
    from justapi.ops.drain import drain
    from justapi.ops.flush_cache import flush_cache
    from justapi.ops.health import health
    from justapi.ops.inspect_gguf import inspect
    from justapi.ops.keys import keys
    from justapi.ops.perplexity import perplexity
    from justapi.ops.status import status

    for command in (serve, status, health, drain, flush_cache, keys, inspect, perplexity, doctor, bench):
        main.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
