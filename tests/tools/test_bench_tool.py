"""`justapi bench serve` (justapi/bench/) against a tiny in-test OpenAI-compatible SSE server (uvicorn in a thread):
token counting, TTFT/ITL/TPOT derivation, percentile math, JSON and plot output, seeded
workloads, pacing, the unreachable-server error and Ctrl-C."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence

import pytest
import uvicorn
from click.testing import CliRunner, Result
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from justapi import cli
from justapi.bench import client as bench_client
from justapi.bench import command as bench
from justapi.bench import report
from justapi.bench import workloads as bench_workloads
from justapi.bench.conversations import build_conversations

CHUNK_TEXTS = ["Hello", " wor", "ld", "!"]  # 4 text chunks ...
USAGE_TOKENS = 6                              # ... carrying 6 tokens (some chunks hold 2)
PROMPT_USAGE_TOKENS = 11
FIRST_DELAY_S = 0.02
FAIL_MAX_TOKENS = 13  # a request with this max_tokens gets an HTTP 500


@dataclass
class Behaviour:
    """What the fake server does; tests swap it, the server thread reads it."""

    send_usage: bool = True
    gap_s: float = 0.005
    bodies: list[dict[str, Any]] = field(default_factory=list)


class FakeServer:
    def __init__(self) -> None:
        self.behaviour = Behaviour()
        self.base_url = ""  # set once uvicorn listens
        routes = [Route("/v1/models", self.models),
                  Route("/v1/completions", self.complete, methods=["POST"]),
                  Route("/v1/chat/completions", self.complete, methods=["POST"])]
        self.app = Starlette(routes=routes)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model"}]})

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.behaviour.bodies.append(body)
        if body.get("max_tokens") == FAIL_MAX_TOKENS:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
        is_chat = request.url.path.endswith("/chat/completions")
        return StreamingResponse(self.events(is_chat, self.behaviour),
                                 media_type="text/event-stream")

    async def events(self, is_chat: bool, behaviour: Behaviour) -> AsyncIterator[str]:
        if is_chat:  # a role-only first chunk carries no token
            yield _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(FIRST_DELAY_S)
        for i, text in enumerate(CHUNK_TEXTS):
            if i:
                await asyncio.sleep(behaviour.gap_s)
            choice = {"index": 0, "delta": {"content": text}} if is_chat else \
                {"index": 0, "text": text}
            yield _event({"choices": [choice]})
        yield _event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if behaviour.send_usage:
            usage = {"prompt_tokens": PROMPT_USAGE_TOKENS, "completion_tokens": USAGE_TOKENS}
            yield _event({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uvicorn_server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning",
                                                   lifespan="off"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]},
                              daemon=True)
    thread.start()
    while not uvicorn_server.started:
        time.sleep(0.01)
    fake.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    uvicorn_server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.behaviour = Behaviour()
    return server


def _requests(num: int) -> list[bench_workloads.BenchRequest]:
    return [bench_workloads.BenchRequest(i, f"prompt {i}", 5, 8) for i in range(num)]


def _run(config: bench_client.ClientConfig, requests: list[bench_workloads.BenchRequest],
         concurrency: int | None = 2) -> bench_client.RunResult:
    pacing = bench_client.Pacing([None] * len(requests), concurrency)
    return asyncio.run(bench_client.run_requests(config, requests, pacing))


# ---------------------------------------------------------------- streaming and timing
def test_completions_stream_counts_tokens_from_usage_and_orders_times(fake: FakeServer) -> None:
    config = bench_client.ClientConfig(fake.base_url, model="m", ignore_eos=True)
    result = _run(config, _requests(3))
    assert [r.index for r in result.records] == [0, 1, 2]
    for record in result.records:
        assert record.ok and record.error is None
        assert record.output_tokens == USAGE_TOKENS and record.output_tokens_source == "usage"
        assert record.prompt_tokens == PROMPT_USAGE_TOKENS
        assert record.num_chunks == len(CHUNK_TEXTS)  # the empty finish chunk is no token
        assert len(record.itl_s) == len(CHUNK_TEXTS) - 1
        assert record.ttft_s is not None and record.e2e_s is not None
        assert FIRST_DELAY_S <= record.ttft_s <= record.e2e_s
        assert record.ttft_s + sum(record.itl_s) <= record.e2e_s
        assert record.tpot_s == pytest.approx(
            (record.e2e_s - record.ttft_s) / (USAGE_TOKENS - 1))
    body = fake.behaviour.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 8 and body["model"] == "m"
    assert body["prompt"].startswith("prompt ")


def test_chat_endpoint_skips_the_role_chunk(fake: FakeServer) -> None:
    config = bench_client.ClientConfig(fake.base_url, endpoint="chat")
    [record] = _run(config, _requests(1)).records
    assert record.ok and record.num_chunks == len(CHUNK_TEXTS)
    assert record.ttft_s is not None and record.ttft_s >= FIRST_DELAY_S
    body = fake.behaviour.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "prompt 0"}]
    assert "ignore_eos" not in body and "model" not in body


class WordTokenizer:
    """A test double with justapi.frontend.text.tokenizer's encode/decode shape: one token per word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join("x" * token_id for token_id in token_ids)


def test_without_usage_tokens_come_from_chunks_or_the_tokenizer(fake: FakeServer) -> None:
    fake.behaviour.send_usage = False
    [by_chunks] = _run(bench_client.ClientConfig(fake.base_url), _requests(1)).records
    assert by_chunks.output_tokens == len(CHUNK_TEXTS)
    assert by_chunks.output_tokens_source == "chunks"
    assert by_chunks.prompt_tokens == 5 and by_chunks.prompt_tokens_source == "target"
    counter = bench_workloads.TokenizerSizer(WordTokenizer())
    config = bench_client.ClientConfig(fake.base_url, counter=counter)
    [by_text] = _run(config, _requests(1)).records
    assert by_text.output_tokens == len("".join(CHUNK_TEXTS).split())  # "Hello world!" -> 2
    assert by_text.output_tokens_source == "tokenizer"


def test_http_errors_are_recorded_per_request(fake: FakeServer) -> None:
    requests = _requests(2) + [bench_workloads.BenchRequest(2, "bad", 5, FAIL_MAX_TOKENS)]
    records = _run(bench_client.ClientConfig(fake.base_url), requests).records
    assert [r.ok for r in records] == [True, True, False]
    assert records[2].error == "HTTP 500: boom"
    summary = report.summarize(records, 1.0)
    assert summary["num_ok"] == 2 and summary["num_failed"] == 1


def test_parse_chunk_shapes() -> None:
    parse = bench_client.parse_chunk
    assert parse('{"choices": [{"text": "ab"}]}', "completions") == ("ab", None)
    assert parse('{"choices": [{"delta": {"content": "c"}}]}', "chat") == ("c", None)
    assert parse('{"choices": [{"delta": {"role": "assistant"}}]}', "chat") == ("", None)
    assert parse('{"choices": [], "usage": {"completion_tokens": 3}}', "chat") == \
        ("", {"completion_tokens": 3})
    with pytest.raises(ValueError, match="overloaded"):
        parse('{"error": {"message": "overloaded"}}', "completions")
    for bad in ("not json", "[1, 2]", '{"choices": ["x"]}', '{"choices": [{"text": 5}]}'):
        with pytest.raises(ValueError, match="malformed SSE chunk"):
            parse(bad, "completions")


def test_arrival_offsets_delay_launches(fake: FakeServer) -> None:
    requests = _requests(3)
    offsets = bench_workloads.poisson_arrivals(3, request_rate=20.0, seed=3)
    pacing = bench_client.Pacing(offsets, concurrency=None)
    config = bench_client.ClientConfig(fake.base_url)
    result = asyncio.run(bench_client.run_requests(config, requests, pacing))
    for record, offset in zip(result.records, offsets):
        assert record.ok and record.start_s >= offset
    assert result.duration_s >= offsets[-1]


# ---------------------------------------------------------------- statistics
def test_percentile_on_known_samples() -> None:
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert report.percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert report.percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert report.percentile([7.0], 99) == 7.0
    np = pytest.importorskip("numpy")
    samples = [random.Random(5).random() for _ in range(101)]
    for q in (1, 50, 90, 99):
        assert report.percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))
    with pytest.raises(ValueError, match="empty"):
        report.percentile([], 50)
    with pytest.raises(ValueError, match="101"):
        report.percentile([1.0], 101)


def test_summary_figures_from_known_records() -> None:
    records = [bench_client.RequestRecord(i, "main", 0.0, ok=True, ttft_s=0.1 * (i + 1),
                                          e2e_s=1.0, itl_s=[0.01, 0.03], output_tokens=10,
                                          prompt_tokens=5) for i in range(4)]
    records.append(bench_client.RequestRecord(4, "main", 0.0, error="HTTP 500: x"))
    summary = report.summarize(records, duration_s=2.0)
    assert summary["num_ok"] == 4 and summary["num_failed"] == 1
    assert summary["request_throughput"] == 2.0
    assert summary["output_throughput"] == 20.0 and summary["total_token_throughput"] == 30.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(250.0)
    assert summary["itl_ms"]["count"] == 8 and summary["itl_ms"]["p50"] == pytest.approx(20.0)
    assert summary["tpot_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None,
                                  "count": 0}


# ---------------------------------------------------------------- workloads
def test_workloads_are_deterministic_for_a_seed() -> None:
    sizer = bench_workloads.EstimateSizer()
    for name in set(bench_workloads.WORKLOADS) - {"multi-turn"}:  # (conversations: below)
        options = bench_workloads.WorkloadOptions(name, num_requests=12, seed=7,
                                                  decode_streams=4)
        first = bench_workloads.build_workload(options, sizer)
        assert first == bench_workloads.build_workload(options, sizer)
        other = bench_workloads.WorkloadOptions(name, num_requests=12, seed=8, decode_streams=4)
        assert first != bench_workloads.build_workload(other, sizer)
        assert len({r.prompt for r in first}) == 12  # every prompt differs
    arrivals = bench_workloads.poisson_arrivals
    assert arrivals(5, 2.0, seed=1) == arrivals(5, 2.0, seed=1) != arrivals(5, 2.0, seed=2)
    talks = bench_workloads.WorkloadOptions("multi-turn", num_requests=3, seed=7, turns=2)
    first = build_conversations(talks, sizer)
    assert first == build_conversations(talks, sizer) != build_conversations(
        replace(talks, seed=8), sizer)
    assert len({c.context for c in first}) == 3 and all(len(c.questions) == 2 for c in first)


def test_workload_shapes() -> None:
    sizer = bench_workloads.EstimateSizer()
    build = bench_workloads.build_workload
    options = bench_workloads.WorkloadOptions
    batch = build(options("batch", num_requests=4), sizer)
    assert {r.max_tokens for r in batch} == {128} and {r.prompt_tokens for r in batch} == {128}
    words = len(batch[0].prompt.split())  # ~128 tokens at TOKENS_PER_WORD
    assert words == round(128 / bench_workloads.TOKENS_PER_WORD)
    shared = build(options("shared-prefix", num_requests=4), sizer)
    prefix = os.path.commonprefix([r.prompt for r in shared])
    assert len(prefix.split()) >= round(512 / bench_workloads.TOKENS_PER_WORD)
    mixed = build(options("mixed", num_requests=200), sizer)
    lengths = [r.max_tokens for r in mixed]
    assert min(lengths) >= 16 and max(lengths) <= 256 and len(set(lengths)) > 50
    tailed = [r.max_tokens for r in build(options("mixed", num_requests=200,
                                                  length_dist="log-uniform"), sizer)]
    assert min(tailed) >= 16 and max(tailed) <= 256 and len(set(tailed)) > 50
    # log-uniform: the median is near the geometric mean (64), uniform's near 136
    assert statistics.median(tailed) < 90 < 110 < statistics.median(lengths)
    assert sum(x > 128 for x in tailed) > 30  # and still a tail of long outputs
    with pytest.raises(ValueError, match="length distribution"):
        options("mixed", length_dist="normal")
    burst = build(options("long-burst", num_requests=10, decode_streams=2, burst_size=4,
                          burst_interval_s=2.0), sizer)
    assert [r.group for r in burst] == ["decode"] * 2 + ["burst"] * 8
    assert [r.arrival_s for r in burst] == [0.0, 0.0] + [1.0] * 4 + [3.0] * 4
    assert all(r.prompt_tokens == 1500 and r.max_tokens == 16 for r in burst[2:])
    copies = build(options("copy", num_requests=2), sizer)
    assert all(r.prompt.startswith("Repeat the following passage word for word:\n\n")
               and r.max_tokens == 300 for r in copies)
    passage = copies[0].prompt.split("\n\n", 1)[1]
    assert len(passage.split()) == round(300 / bench_workloads.TOKENS_PER_WORD)
    with pytest.raises(ValueError, match="multi-turn builds conversations"):
        build(options("multi-turn"), sizer)
    with pytest.raises(ValueError, match="nope"):
        options("nope")
    with pytest.raises(ValueError, match="decode_streams"):
        options("long-burst", num_requests=8, decode_streams=8)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    offsets = bench_workloads.poisson_arrivals(4000, request_rate=8.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 8.0, rel=0.05)
    with pytest.raises(ValueError, match="-1"):
        bench_workloads.poisson_arrivals(3, -1.0, 0)


def test_tokenizer_sizer_sizes_prompts_exactly() -> None:
    sizer = bench_workloads.TokenizerSizer(WordTokenizer())
    for num_tokens in (1, 17, 300):
        assert sizer.count(sizer.make_text(random.Random(num_tokens), num_tokens)) == num_tokens


def test_tokenizer_sizer_with_the_default_gguf() -> None:
    pytest.importorskip("justapi.frontend.text.tokenizer")
    from justapi.model.gguf_file import default_model_path

    try:
        path = default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    sizer = bench_workloads.load_tokenizer_sizer(path)
    text = sizer.make_text(random.Random(0), 200)
    assert abs(sizer.count(text) - 200) <= 2  # re-encoding may move the cut by a token


# ---------------------------------------------------------------- the command line
def bench_serve(*args: str) -> Result:
    """`justapi bench serve ARGS` through the `justapi` group (stdout and stderr apart)."""
    return CliRunner().invoke(cli.main, ["bench", "serve", *args])


def test_main_writes_json_and_plot(fake: FakeServer, tmp_path: Path) -> None:
    json_path, plot_path = tmp_path / "out.json", tmp_path / "cdf.png"
    argv = ["--base-url", fake.base_url, "--workload", "long-burst", "--num-requests", "5",
            "--decode-streams", "2", "--burst-size", "2", "--burst-interval-s", "0.05",
            "--prompt-tokens", "40", "--json", str(json_path)]
    has_matplotlib = _has_module("matplotlib")
    if has_matplotlib:
        argv += ["--plot", str(plot_path)]
    result = bench_serve(*argv)
    assert result.exit_code == bench.EXIT_OK, result.output
    out = result.stdout
    assert "Requests ok / failed:" in out and "group decode (2 ok)" in out
    written = json.loads(json_path.read_text())
    assert set(written) == {"config", "interrupted", "summary", "groups", "requests"}
    assert written["config"]["model"] == "fake-model" and written["interrupted"] is False
    assert written["config"]["num_requests"] == 5 and written["config"]["concurrency"] is None
    assert "api_key" not in written["config"]
    assert set(written["groups"]) == {"decode", "burst"}
    summary = written["summary"]
    for key in ("num_ok", "num_failed", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms",
                "itl_ms", "e2e_ms"):
        assert key in summary
    assert summary["num_ok"] == 5 and summary["total_output_tokens"] == 5 * USAGE_TOKENS
    assert set(summary["itl_ms"]) == {"p50", "p90", "p99", "mean", "count"}
    assert len(written["requests"]) == 5 and written["requests"][0]["itl_s"]
    assert fake.behaviour.bodies[0]["model"] == "fake-model"
    if has_matplotlib:
        assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_turn_sends_each_turn_with_the_transcript(fake: FakeServer, tmp_path: Path) -> None:
    json_path = tmp_path / "turns.json"
    result = bench_serve("--base-url", fake.base_url, "--workload", "multi-turn",
                         "--num-requests", "2", "--turns", "3", "--prompt-tokens", "20",
                         "--max-tokens", "8", "--json", str(json_path))
    assert result.exit_code == bench.EXIT_OK, result.output
    assert "group turn-1 (2 ok)" in result.stdout and "group turns-2+ (4 ok)" in result.stdout
    prompts = [body["prompt"] for body in fake.behaviour.bodies]
    assert len(prompts) == 6 and all(p.endswith("\nAssistant:") for p in prompts)
    answer = "".join(CHUNK_TEXTS)
    for prompt in prompts:  # a later turn = an earlier turn's prompt + the answer + a question
        if prompt.count("User: ") > 1:
            earlier = prompt.rsplit("User: ", 1)[0]
            assert earlier.endswith(answer + "\n") and earlier[:-len(answer) - 1] in prompts
    assert sum(p.count("User: ") == 3 for p in prompts) == 2
    written = json.loads(json_path.read_text())
    assert written["config"]["num_requests"] == 2 and written["config"]["turns"] == 3
    assert sorted(r["index"] for r in written["requests"]) == list(range(6))
    assert all(r["output_text"] == answer for r in written["requests"])
    rejected = bench_serve("--base-url", fake.base_url, "--workload", "multi-turn",
                           "--request-rate", "2")
    assert rejected.exit_code == bench.EXIT_USAGE and "drop --request-rate" in rejected.output


def test_unreachable_server_fails_with_one_line() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = bench_serve("--base-url", f"http://127.0.0.1:{port}", "--no-progress")
    err = result.stderr
    assert result.exit_code == bench.EXIT_USAGE and result.stdout == ""
    assert err.count("\n") == 1
    assert err.startswith("justapi bench serve: error: cannot reach server at")


def test_length_dist_flag_reaches_the_mixed_workload() -> None:
    def lengths(*flags: str) -> list[int]:
        context = bench.bench_serve.make_context("serve", ["--workload", "mixed", *flags])
        options = bench.BenchOptions(**context.params)
        return [r.max_tokens for r in bench.plan_run(options).requests]
    expected = bench_workloads.build_workload(
        bench_workloads.WorkloadOptions("mixed", length_dist="log-uniform"),
        bench_workloads.EstimateSizer())
    assert lengths("--length-dist", "log-uniform") == [r.max_tokens for r in expected]
    assert lengths() != lengths("--length-dist", "log-uniform")


def test_bad_flags_fail_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: str) -> str:
        result = bench_serve(*args)
        assert result.exit_code == bench.EXIT_USAGE and result.stdout == ""
        assert result.stderr.count("\n") == 1, result.stderr  # one line, no traceback
        return result.stderr

    assert "--workload single sends one stream at a time" in fails(
        "--workload", "single", "--concurrency", "4")
    assert "--concurrency must be >= 1, got 0" in fails("--concurrency", "0")
    assert "num_requests must be >= 1, got 0" in fails("--num-requests", "0")
    assert "drop --request-rate" in fails("--workload", "long-burst", "--request-rate", "2")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert fails("--plot", "x.png") == "justapi bench serve: error: --plot needs matplotlib: " \
        "pip install matplotlib (or pip install -e '.[bench]')\n"
    unknown = bench_serve("--workload", "nope")  # click's own usage error, also exit 2
    assert unknown.exit_code == bench.EXIT_USAGE and "'nope' is not one of" in unknown.stderr


def test_unwritable_json_path_fails_with_a_message(fake: FakeServer, tmp_path: Path) -> None:
    result = bench_serve("--base-url", fake.base_url, "--workload", "single", "--num-requests",
                         "1", "--no-progress", "--json", str(tmp_path))  # a directory
    assert result.exit_code == bench.EXIT_USAGE
    assert "justapi bench serve: error: cannot write output" in result.stderr


def test_help_exits_zero() -> None:
    result = bench_serve("--help")
    assert result.exit_code == 0
    assert "--request-rate" in result.stdout and "workload defaults" in result.stdout
    assert "serve" in CliRunner().invoke(cli.main, ["bench", "--help"]).stdout


def test_ctrl_c_prints_a_partial_summary(fake: FakeServer) -> None:
    fake.behaviour.gap_s = 0.3  # each request takes about a second
    command = [sys.executable, "-m", "justapi.cli", "bench", "serve", "--base-url",
               fake.base_url, "--workload", "single", "--num-requests", "50", "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        while not fake.behaviour.bodies:  # the run (and its SIGINT handler) started
            assert process.poll() is None, process.communicate()
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=15)
    finally:
        process.kill()
    assert process.returncode == bench.EXIT_INTERRUPTED, err
    assert "(interrupted)" in out and "Traceback" not in err


def _has_module(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True
