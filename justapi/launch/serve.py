"""`justapi serve`: flags (+ a TOML config) -> a running process pool, stopped in order on
SIGINT/SIGTERM. Errors are one readable line and a non-zero exit.

Owns: the serve flags and the start-up banner. Does not own: the processes (launcher.py).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import click

from justapi.config.sections import WEIGHT_MODES, ConfigError
from justapi.config.serve import API_KEY_ENV, ServeConfig, build_config, load_toml
from justapi.launch import discovery
from justapi.launch.child import StopFlag
from justapi.launch.launcher import Deployment, Launcher, LaunchError
from justapi.model.check import check_draft_model, check_model_file
from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.info import ModelInfo, resolve_model
from justapi.wire.curve_keys import public_key_of, read_secret_key


def _flags(fn: Any) -> Any:
    options = [
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     help="TOML file; keys named as these flags, flags win."),
        click.option("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct), "
                                     "or synthetic:layers=2,hidden=64,... for random weights."),
        click.option("--workers", type=int, help="Worker processes (default 1)."),
        click.option("--threads", type=int, help="torch threads per CPU worker (default: the "
                                                  "cores divided among the workers)."),
        click.option("--cpu-spin", type=int,
                     help="CPU workers: GOMP_SPINCOUNT of a thread waiting at a barrier "
                          "(-1 auto: 10000 unless the model is tiny or the threads outnumber "
                          "the cores; 0: sleep at once)."),
        click.option("--launcher", type=click.Choice(["local", "ray"]),
                     help="Where workers run: local processes (default), or Ray actors on the "
                          "nodes of a Ray cluster (docs/scale-out.md)."),
        click.option("--address", help="Ray cluster address HOST:PORT (--launcher ray)."),
        click.option("--gpu", "device", flag_value="cuda", default=None,
                     help="Run workers on CUDA GPUs (one per GPU)."),
        click.option("--pd", help="Prefill/decode disaggregation: P prefill and D decode "
                                  "workers, e.g. 1:1 (sets --workers to P + D)."),
        click.option("--pd-separate-pools/--pd-shared-pool", default=None,
                     help="CPU: a KV segment per PD side, so hand-offs copy blocks (shared)."),
        click.option("--pd-lease-s", type=float,
                     help="An unclaimed PD hand-off is taken back after this long (30)."),
        click.option("--scheduled/--no-scheduled", default=None,
                     help="Continuous batching (default) or static batching."),
        click.option("--max-seqs", type=int, help="Most requests per step (32)."),
        click.option("--max-prefill", type=int, help="Most requests mid-prefill per step (4)."),
        click.option("--max-decode", type=int, help="Most decoding requests per step (32)."),
        click.option("--chunk-size", type=int, help="Prompt tokens per request per step (512)."),
        click.option("--max-batched-tokens", type=int, help="Token budget of one step (2048)."),
        click.option("--policy", type=click.Choice(["fcfs", "priority", "lpm"]),
                     help="Waiting-queue order (fcfs)."),
        click.option("--pool-blocks", type=int, help="KV blocks per pool (0: size from memory)."),
        click.option("--block-size", type=int, help="Tokens per KV block (16)."),
        click.option("--prefix-cache/--no-prefix-cache", "enable_prefix_cache", default=None,
                     help="Share cached KV blocks of identical prefixes (default on)."),
        click.option("--max-context", type=int, help="Cap on the model's context length."),
        click.option("--weights", type=click.Choice(list(WEIGHT_MODES)),
                     help="fp32: dequantize at load; bf16: the same, multiplied in bf16 on CPUs "
                          "with AVX512-BF16/AMX; q4: keep Q4_0/Q4_1/Q8_0 weights 4-bit "
                          "(int4 kernels); auto: both, 4-bit for small steps (default fp32)."),
        click.option("--host", help="HTTP bind address (127.0.0.1)."),
        click.option("--port", type=int, help="HTTP port (8000; 0 picks a free one)."),
        click.option("--zmq", help="ZMQ client endpoint, e.g. tcp://127.0.0.1:5555."),
        click.option("--served-model-name", help="Model id for /v1/models."),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"])),
        click.option("--ready-timeout-s", type=float, help="Start-up timeout per process (120)."),
        click.option("--restart-workers/--no-restart-workers", default=None,
                     help="Start a replacement for a worker that dies (off)."),
        click.option("--heartbeat-timeout-s", type=float,
                     help="A worker silent this long is unhealthy (1.5)."),
        click.option("--step-timeout-s", type=float,
                     help="A step in flight this long is hung; its worker is fenced (120)."),
        click.option("--admin", help="Admin socket for tools/ (default: ipc in the runtime dir; "
                                     "tcp must be loopback)."),
        click.option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                     help="Bearer key every HTTP route but /health needs (prefer the "
                          "environment variable: a flag is visible to `ps`)."),
        click.option("--max-request-bytes", type=int,
                     help="Larger HTTP request bodies get 413 (4 MiB)."),
        click.option("--max-queue", type=int,
                     help="Requests admitted beyond max-seqs x workers; past that 429 (1024)."),
        click.option("--shutdown-grace-s", type=float,
                     help="On SIGTERM, in-flight requests get this long to finish (30)."),
        click.option("--log-requests/--no-log-requests", default=None,
                     help="Log each request's prompt and parameters (off)."),
        click.option("--spec", type=click.Choice(["ngram", "draft"]),
                     help="Speculative decoding proposer: ngram (prompt lookup) or draft "
                          "(--draft-model); off by default."),
        click.option("--draft-model", help="Draft GGUF (same vocabulary) proposing tokens that "
                                           "the model verifies; implies --spec draft."),
        click.option("--gamma", type=int, help="Tokens proposed per step along one path (4)."),
        click.option("--branch", type=int, help="Children per node of the token tree (1: a chain)."),
        click.option("--spec-tree", help="Tree shape: children per node at each depth, e.g. 3,2,1."),
        click.option("--spec-budget", type=int,
                     help="Draft tokens verified per request per step (0: gamma x branch)."),
        click.option("--spec-adaptive/--no-spec-adaptive", default=None,
                     help="Propose fewer tokens when acceptance is poor or the batch large (on)."),
        click.option("--zmq-curve-secret-key", type=click.Path(dir_okay=False),
                     help="z85 CURVE secret key file of the ZMQ endpoint (needed for tcp "
                          "beyond loopback; tools/curve_keys.py makes one)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command()
@_flags
def serve(config_path: str | None, api_key: str | None, **flags: Any) -> None:
    """Serve a GGUF model over an OpenAI-compatible HTTP API and a ZMQ client API."""
    try:
        file_values = load_toml(config_path) if config_path else {}
        config = build_config(file_values, {k: v for k, v in flags.items() if v is not None})
        gguf = GGUFFile(resolve_model(config.model.model))
        model = ModelInfo.from_gguf(gguf)
        check_model_file(gguf, model)
        check_draft_model(config, model)
        if config.server.zmq_curve_secret_key:
            read_secret_key(config.server.zmq_curve_secret_key)
    except (ConfigError, GGUFError, ValueError) as exc:
        _fail(str(exc))
    os.environ.pop(API_KEY_ENV, None)  # only the frontend's environment will hold the key
    sys.exit(run_server(config, model, api_key=api_key or ""))


def run_server(config: ServeConfig, model: ModelInfo, *, api_key: str = "") -> int:
    stop = StopFlag()
    signal.signal(signal.SIGINT, stop.set)
    signal.signal(signal.SIGTERM, stop.set)
    try:
        launcher = make_launcher(config, model, api_key)
        deployment = launcher.start()
    except (LaunchError, ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    click.echo(banner(config, deployment), err=True)
    state_file = _publish(deployment)
    try:
        reason = launcher.wait(lambda: stop.is_set)
    finally:
        if state_file:
            discovery.unpublish(state_file)
    click.echo(f"justapi: stopping ({reason})", err=True)
    launcher.shutdown()
    return 0 if reason == "stop requested" else 1


def make_launcher(config: ServeConfig, model: ModelInfo, api_key: str) -> Launcher:
    if config.server.launcher == "ray":
        from justapi.cluster.launcher import RayLauncher  # Ray is an optional extra

        return RayLauncher(config, model, api_key=api_key)
    return Launcher(config, model, api_key=api_key)


def _publish(deployment: Deployment) -> str:
    """Make this server discoverable by tools/ (justapi/launch/discovery.py); '' if it cannot be."""
    endpoints = deployment.endpoints
    record = discovery.ServerRecord(pid=os.getpid(), admin=endpoints.admin,
                                    client=deployment.zmq_url, http_url=deployment.http_url,
                                    model=deployment.model.name, runtime_dir=endpoints.runtime_dir)
    try:
        return discovery.publish(record)
    except (OSError, discovery.DiscoveryError) as exc:
        click.echo(f"justapi: warning: tools cannot find this server without --admin ({exc})",
                   err=True)
        return ""


def banner(config: ServeConfig, deployment: Deployment) -> str:
    m, pool = deployment.model, deployment.pool
    if pool.get("kind") == "hosts":  # --launcher ray: a pool per host
        pool_text = "; ".join(_host_text(row) for row in pool["hosts"])
    elif pool:
        pool_text = (f"{pool['num_blocks']} blocks x {pool['block_size']} tokens, "
                     f"{pool['num_blocks'] * m.kv_bytes_per_token() * pool['block_size'] / 2**20:.0f} MiB"
                     " shared by the CPU workers")
    else:
        pool_text = "one pool per GPU worker (sized on the device)"
    lines = [
        f"justapi: model {m.name} ({m.architecture}, {m.num_layers} layers, context "
        f"{m.context_length}) from {m.path}",
        f"justapi: {config.server.workers} worker(s) on {config.model.device}, weights "
        f"{config.model.weights}; KV pool {pool_text}",
        *_pd_lines(config),
        f"justapi: HTTP  {deployment.http_url}/v1 (OpenAI-compatible), /health, /metrics",
        f"justapi: ZMQ   {deployment.zmq_url} (justapi.client){_curve_text(config)}",
        f"justapi: admin {deployment.endpoints.admin} (justapi status, health, drain, flush-cache)",
    ]
    return "\n".join(lines)


def _host_text(row: dict) -> str:
    pool = row.get("pool") or {}
    size = f", {pool['num_blocks']} blocks" if pool else ", its own device pool"
    return f"host {row['host']}: worker(s) {', '.join(map(str, row['workers']))}{size}"


def _curve_text(config: ServeConfig) -> str:
    path = config.server.zmq_curve_secret_key
    if not path:
        return ""
    return f", CURVE: server public key {public_key_of(read_secret_key(path)).decode()}"


def _pd_lines(config: ServeConfig) -> list[str]:
    pd = config.pd
    if not pd.is_enabled:
        return []
    how = ("by copy (a KV pool per side)" if pd.pd_separate_pools or config.model.device != "cpu"
           else "zero-copy (one shared KV pool)")
    if config.server.launcher == "ray":
        how = "zero-copy within a host's KV pool, by copy over the wire between hosts"
    return [f"justapi: PD {pd.pd}: workers 0-{pd.num_prefill - 1} prefill, "
            f"{pd.num_prefill}-{pd.num_workers - 1} decode; hand-off {how}"]


def _fail(message: str) -> None:
    click.echo(f"justapi: error: {message}", err=True)
    sys.exit(2)
