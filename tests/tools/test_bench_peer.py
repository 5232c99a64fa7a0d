"""`python -m tools.bench peer`: its workloads are the issue's shapes, its figures (burst ITL
window, later turns' TTFT) and ratio orientation are right, and it starts llama-server with
the agreed flags and stops it (a stand-in binary here); `--base-tree` runs that tree's code."""
from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from justapi.bench.client import RequestRecord, RunResult
from tools.bench import peer
from tools.harness import TINY_MODEL

STAND_IN = f"""#!{sys.executable}
import http.server, sys
open({{path!r}}, "w").write(" ".join(sys.argv[1:]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def stream(group: str, start_s: float, ttft_s: float, itl_s: list[float]) -> RequestRecord:
    return RequestRecord(0, group, start_s, ok=True, ttft_s=ttft_s, itl_s=itl_s)


def test_the_workloads_are_the_agreed_shapes():
    shapes = peer.workloads()
    assert list(shapes) == ["batch", "mixed", "prefix", "single", "copy", "burst", "multiturn"]
    batch = shapes["batch"].options
    assert (batch.num_requests, batch.concurrency, batch.prompt_tokens, batch.max_tokens) == (
        64, 16, 128, 128)
    assert shapes["prefix"].options.prompt_tokens == 510
    burst = shapes["burst"].options
    assert (burst.decode_streams, burst.burst_size, burst.prompt_tokens) == (8, 8, 1500)
    talk = shapes["multiturn"].options
    assert (talk.num_requests, talk.turns) == (16, 4)
    assert all(w.options.ignore_eos and w.options.seed == 0 for w in shapes.values())
    assert [w.higher_is_better for w in shapes.values()] == [True] * 5 + [False] * 2


def test_burst_itl_counts_only_the_gaps_that_overlap_the_burst():
    records = [stream("decode", 0.0, 0.5, [0.1] * 10 + [2.0, 0.1, 0.1]),  # 2 s gap in the burst
               stream("decode", 0.0, 0.5, [0.1] * 30),
               stream("burst", 1.45, 1.0, [0.1]),  # prefilled from 1.45 s until 2.45 s
               stream("burst", 1.45, 0.9, [])]
    p99 = peer.burst_itl_p99_s(RunResult(records, 4.0))
    assert p99 is not None and 1.5 < p99 <= 2.0
    calm = [stream("decode", 0.0, 0.5, [0.1] * 30), stream("burst", 1.0, 0.5, [])]
    assert peer.burst_itl_p99_s(RunResult(calm, 4.0)) == pytest.approx(0.1)
    assert peer.burst_itl_p99_s(RunResult(records[:2], 4.0)) is None


def test_later_turns_ttft_and_ratios():
    records = [RequestRecord(i, "turn-1" if i < 2 else "turns-2+", 0.0, ok=True,
                             ttft_s=[9.0, 9.0, 0.2, 0.4, 0.6][i], e2e_s=10.0) for i in range(5)]
    assert peer.later_turns_ttft_s(RunResult(records, 10.0)) == pytest.approx(0.4)
    assert peer.ratio(100.0, 50.0, higher_is_better=True) == 2.0
    assert peer.ratio(0.5, 2.0, higher_is_better=False) == 4.0  # half the latency: 4x better
    assert peer.ratio(None, 2.0, True) is None and peer.ratio(1.0, 0.0, True) is None


def test_llama_server_gets_the_agreed_flags_and_is_stopped(tmp_path: Path):
    args_file = tmp_path / "args.txt"
    binary = tmp_path / "llama-server"
    binary.write_text(STAND_IN.format(path=str(args_file)))
    binary.chmod(0o755)
    with peer.llama_server(str(binary), "model.gguf", 2, ["--no-webui"]) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        argv = args_file.read_text().split()
    assert argv[:2] == ["-m", "model.gguf"]
    assert " ".join(argv[argv.index("-t"):]) == "-t 2 -np 16 -c 32768 --no-webui"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=1)


@pytest.mark.e2e
def test_the_base_server_runs_the_base_trees_code(tmp_path: Path):
    """`--base-tree`: the base server runs that tree's code, not this one's (`python -m` puts
    the directory it starts in first on sys.path, ahead of PYTHONPATH)."""
    here = Path(__file__).resolve().parents[2]
    tree = tmp_path / "base"
    for package in ("justapi", "workers"):
        shutil.copytree(here / package, tree / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    api = tree / "justapi" / "frontend" / "api_server.py"
    source = api.read_text()
    assert '"owned_by": "justapi"' in source
    api.write_text(source.replace('"owned_by": "justapi"', '"owned_by": "the-base-tree"'))
    for where, owner in ((str(tree), "the-base-tree"), (None, "justapi")):
        with peer.justapi_server(["--model", TINY_MODEL], where) as url:
            models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert models[0]["owned_by"] == owner, where


def test_turns_alternate_who_goes_first_and_report_the_median_ratio(capsys):
    """`--turns N`: who goes first alternates across turns and workloads, every turn's ratio is
    printed and the median (with the spread) is the one to read on a host whose figures fall
    in two groups."""
    a, b = (peer.Server(name, lambda: contextlib.nullcontext("")) for name in ("justapi", "llama-server"))
    orders = [[s.name for s in peer.turn_order([a, b], w, t)] for w in (0, 1) for t in (0, 1)]
    assert orders == [["justapi", "llama-server"], ["llama-server", "justapi"],
                      ["llama-server", "justapi"], ["justapi", "llama-server"]]
    turns = [{"justapi": {"figure": f}, "llama-server": {"figure": 100.0}} for f in (500.0, 350.0, 410.0)]
    report = peer.show("prefix", peer.workloads()["prefix"], turns)
    assert report["turn_ratios"] == [{"justapi/llama-server": 5.0}, {"justapi/llama-server": 3.5},
                                     {"justapi/llama-server": 4.1}]
    assert report["median_ratios"] == {"justapi/llama-server": (4.1, 3.5, 5.0)}
    printed = capsys.readouterr().out
    assert printed.count("justapi/llama-server") == 4 and "median of 3 turns" in printed
    latency = [{"justapi": {"figure": 0.2}, "llama-server": {"figure": f}} for f in (1.0, None)]
    assert peer.show("burst", peer.workloads()["burst"], latency)["median_ratios"] == {
        "justapi/llama-server": (5.0, 5.0, 5.0)}  # a turn without a figure is left out
    one = peer.show("batch", peer.workloads()["batch"], turns[:1])
    assert "median_ratios" not in one and one["ratios"] == {"justapi/llama-server": 5.0}
