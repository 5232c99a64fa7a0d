"""Structured outputs and tool calls on the shared real-world corpora, against `justapi serve`
and (where built) llama-server (`--jinja`), side by side in one run.

  schemas   every SchemaStore schema's prompt with `response_format: json_schema` (best
            effort, and again with "strict": true): accepted (200), finished ("stop"),
            valid (the reply validates against the schema: jsonschema, formats checked)
  tools     every BFCL case with `tool_choice: "required"`: replies with a call, calls that
            parse and validate against their tool's parameters, correct by BFCL's answers
  speed     output tok/s of schema prompts constrained vs free, at batch 1 and 16: each free
            request gets its constrained twin's length (max_tokens, ignore_eos), constrained
            and free runs alternating on one server (the ratio is the figure)

Greedy decoding, the same GGUF for both servers. The machine is shared: only the ratios
inside one run mean much.

    python -m tools.bench structured-corpus
    python -m tools.bench structured-corpus --llama-server PATH/llama-server --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from justapi.model.gguf_file import resolve_model_path
from justapi.structured.validation import first_violation, json_violation
from tools.bench.peer import llama_server
from tools.corpora import SchemaCase, ToolCase, corpora_dir, is_correct, schema_cases, tool_cases
from tools.harness import ServedPool

PROG = "python -m tools.bench structured-corpus"
LLAMA_SERVER_ENV = "JUSTAPI_LLAMA_SERVER"
"""Where llama-server is when --llama-server is not given (docs/bench.md has the build)."""
TIMEOUT_S = 900.0
Reply = tuple[int, dict[str, Any], float]
"""(HTTP status, the JSON body, seconds)."""


async def post_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[Reply]:
    """Every body to /v1/chat/completions, `concurrency` at a time, replies in order."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        async def one(body: dict[str, Any]) -> Reply:
            async with gate:
                start = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=body)
                try:
                    payload = response.json()
                except ValueError:
                    payload = {"error": response.text[:200]}
                return response.status_code, payload, time.perf_counter() - start
        return list(await asyncio.gather(*(one(body) for body in bodies)))


def schema_body(case: SchemaCase, strict: bool, max_tokens: int) -> dict[str, Any]:
    fmt = {"name": "reply", "schema": case.schema, **({"strict": True} if strict else {})}
    return {"messages": [{"role": "user", "content": case.prompt}], "max_tokens": max_tokens,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": fmt}}


def score_schemas(cases: list[SchemaCase], replies: list[Reply]) -> dict[str, Any]:
    accepted = finished = valid = 0
    invalid: list[str] = []
    outcomes: dict[str, str] = {}
    for case, (status, body, _) in zip(cases, replies, strict=True):
        if status != 200:
            outcomes[case.file] = f"refused: {str(body.get('error'))[:160]}"
            continue
        accepted += 1
        choice = body["choices"][0]
        outcomes[case.file] = choice["finish_reason"]
        if choice["finish_reason"] != "stop":
            continue
        finished += 1
        violation = json_violation(json.dumps(case.schema), choice["message"]["content"] or "")
        valid += not violation
        if violation:
            invalid.append(f"{case.file}: {violation[:120]}")
            outcomes[case.file] = f"invalid: {violation[:120]}"
    return {"n": len(cases), "accepted": accepted, "finished": finished, "valid": valid,
            "invalid": invalid, "outcomes": outcomes}


def tool_body(case: ToolCase, max_tokens: int) -> dict[str, Any]:
    return {"messages": case.messages, "tools": case.tools, "tool_choice": "required",
            "parallel_tool_calls": True, "max_tokens": max_tokens, "temperature": 0}


def score_tools(cases: list[ToolCase], replies: list[Reply]) -> dict[str, Any]:
    with_call = valid = correct = 0
    without: list[str] = []
    for case, (status, body, _) in zip(cases, replies, strict=True):
        calls = (body["choices"][0]["message"].get("tool_calls") or []) if status == 200 else []
        if not calls:
            without.append(case.id)
            continue
        with_call += 1
        parsed = [_call(case, call) for call in calls]
        if all(arguments is not None for _, arguments in parsed):
            valid += 1
            correct += is_correct(case, parsed)  # type: ignore[arg-type]
    return {"n": len(cases), "with_call": with_call, "valid": valid, "correct": correct,
            "without_call": without}


def _call(case: ToolCase, call: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(name, arguments) when the call names a tool and its arguments validate, else None."""
    name = call["function"]["name"]
    tool = next((t for t in case.tools if t["function"]["name"] == name), None)
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return name, None
    if tool is None or first_violation(json.dumps(tool["function"]["parameters"]), arguments):
        return name, None
    return name, arguments


async def speed(url: str, cases: list[SchemaCase], batch: int, max_tokens: int,
                rounds: int) -> dict[str, float]:
    """Output tok/s constrained and free over the same prompts, runs alternating; each free
    request decodes exactly as many tokens as its constrained twin did."""
    totals = {"constrained": [0, 0.0], "free": [0, 0.0]}
    for _ in range(rounds):
        bodies = [schema_body(case, False, max_tokens) for case in cases]
        lengths = await _timed(url, bodies, batch, totals["constrained"])
        free = [{**{k: v for k, v in body.items() if k != "response_format"},
                 "max_tokens": max(1, length), "ignore_eos": True}
                for body, length in zip(bodies, lengths)]
        await _timed(url, free, batch, totals["free"])
    rates = {kind: tokens / seconds for kind, (tokens, seconds) in totals.items()}
    return {**rates, "ratio": rates["constrained"] / rates["free"]}


async def _timed(url: str, bodies: list[dict[str, Any]], batch: int,
                 total: list[float]) -> list[int]:
    """Run the bodies; add (tokens, seconds) to total; each reply's completion tokens."""
    start = time.perf_counter()
    replies = await post_all(url, bodies, batch)
    total[1] += time.perf_counter() - start
    lengths = [b.get("usage", {}).get("completion_tokens", 0) if status == 200 else 0
               for status, b, _ in replies]
    total[0] += sum(lengths)
    return lengths


def run_server(name: str, url: str, args: argparse.Namespace, schemas: list[SchemaCase],
               tools: list[ToolCase]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = (False, True) if name == "justapi" else (False,)  # llama-server has no strict mode
    for strict in modes if "schemas" in args.sections else ():
        bodies = [schema_body(case, strict, args.max_tokens) for case in schemas]
        mode = "strict" if strict else "best_effort"
        out[mode] = score_schemas(schemas, asyncio.run(post_all(url, bodies, args.concurrency)))
        _progress(name, f"schemas {mode}")
    if "tools" in args.sections:
        replies = asyncio.run(post_all(url, [tool_body(c, args.max_tokens) for c in tools],
                                       args.concurrency))
        out["tools"] = score_tools(tools, replies)
        _progress(name, "tools")
        out["tools_by_category"] = {
            category: score_tools([c for c in tools if c.category == category],
                                  [r for c, r in zip(tools, replies) if c.category == category])
            for category in dict.fromkeys(c.category for c in tools)}
    fast = [c for c in schemas if c.file in args.speed_files] or schemas[:16]
    for batch in args.batches if "speed" in args.sections else ():
        out[f"speed_batch_{batch}"] = asyncio.run(speed(
            url, fast[:max(batch, 4)], batch, args.speed_tokens, args.rounds))
        _progress(name, f"speed at batch {batch}")
    return out


def _progress(name: str, what: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {name}: {what} done (load average "
          f"{os.getloadavg()[0]:.1f})", flush=True)


@contextlib.contextmanager
def justapi_server(serve_args: list[str]) -> Iterator[str]:
    with ServedPool("--log-level", "warning", *serve_args) as pool:
        yield pool.base_url


def show(name: str, figures: dict[str, Any]) -> None:
    for mode in ("best_effort", "strict"):
        if mode in figures:
            f = figures[mode]
            print(f"{name:<13} schemas {mode:<11} accepted {f['accepted']}/{f['n']}  finished "
                  f"{f['finished']}  valid {f['valid']}/{f['finished']}")
    if "tools" in figures:
        t = figures["tools"]
        print(f"{name:<13} tools required      with a call {t['with_call']}/{t['n']}  "
              f"valid {t['valid']}  correct {t['correct']}")
    for category, t in figures.get("tools_by_category", {}).items():
        print(f"{name:<13}   {category:<17} with a call {t['with_call']}/{t['n']}  valid "
              f"{t['valid']}  correct {t['correct']}")
    for key, value in figures.items():
        if key.startswith("speed_batch_"):
            print(f"{name:<13} {key.replace('_', ' '):<19} constrained {value['constrained']:.1f}"
                  f" tok/s  free {value['free']:.1f} tok/s  ratio {value['ratio']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = corpora_dir()
    if root is None:
        raise SystemExit(f"{PROG}: no shared corpora (../shared/corpora or JUSTAPI_CORPORA)")
    schemas = schema_cases(root)[:args.num_schemas or None]
    tools = tool_cases(root)[:args.num_tools or None]
    servers = [("justapi", lambda: justapi_server(["--model", args.gguf, *args.serve_arg]))]
    if args.llama_server and Path(args.llama_server).is_file() and not args.justapi_only:
        servers.append(("llama-server", lambda: llama_server(
            args.llama_server, args.gguf, args.threads, ["--jinja", *args.peer_arg])))
    print(f"# load average {os.getloadavg()[0]:.2f}; servers: "
          f"{', '.join(name for name, _ in servers)}; {len(schemas)} schemas, "
          f"{len(tools)} tool cases", flush=True)
    report = {}
    for name, start in servers:
        chosen = tools if name == "justapi" else _spread(tools, args.peer_num_tools)
        with start() as url:
            report[name] = run_server(name, url, args, schemas, chosen)
        show(name, report[name])
        if args.json:  # after each server: a long run interrupted keeps what it measured
            Path(args.json).write_text(json.dumps({"args": vars(args), "servers": report},
                                                  indent=1))
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


def _spread(cases: list[ToolCase], limit: int) -> list[ToolCase]:
    """At most `limit` cases (0: all), the same number from each category, in order."""
    if not limit or limit >= len(cases):
        return cases
    categories = list(dict.fromkeys(case.category for case in cases))
    per = max(1, limit // len(categories))
    return [c for category in categories for c in
            [c for c in cases if c.category == category][:per]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV, ""),
                        help=f"llama-server binary (default ${LLAMA_SERVER_ENV}; skipped when "
                             "absent)")
    parser.add_argument("--gguf", default="", help="the model (default: the embedded SmolLM2)")
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument("--peer-arg", action="append", default=[])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-schemas", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--num-tools", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                        default=[1, 16])
    parser.add_argument("--speed-tokens", type=int, default=128)
    parser.add_argument("--speed-files", type=lambda s: s.split(","), default=[])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sections", type=lambda s: s.split(","),
                        default=["schemas", "tools", "speed"])
    parser.add_argument("--justapi-only", action="store_true", help="no llama-server")
    parser.add_argument("--peer-num-tools", type=int, default=0,
                        help="llama-server: at most N tool cases, spread over the categories "
                             "(0: all)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    args.gguf = resolve_model_path(args.gguf)
    return args


if __name__ == "__main__":
    main()
