"""`justapi serve`: flags (+ a TOML config) -> a running process pool, stopped in order on
SIGINT/SIGTERM. Errors are one readable line and a non-zero exit.

Owns: the command (its flags come from the config fields: justapi/config/flags.py) and the
start-up banner. Does not own: the processes (launcher.py).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import click

from justapi.config.fields import ConfigError
from justapi.config.flags import with_config_options
from justapi.config.serve import API_KEY_ENV, ServeConfig, build_config, load_toml
from justapi.launch import discovery
from justapi.launch.child import StopFlag
from justapi.launch.launcher import Deployment, Launcher, LaunchError
from justapi.launch.shm_pool import DTYPE_BYTES
from justapi.model.check import check_draft_model, check_model_file
from justapi.model.gguf_file import GGUFError, GGUFFile
from justapi.model.info import ModelInfo, model_sampling_defaults, resolve_model
from justapi.model.weight_types import check_weight_types
from justapi.sampling import SamplingDefaults
from justapi.wire.auth import public_key_of, read_secret_key


def _serve_flags(command: Any) -> Any:
    """The flags of every config field (justapi/config/flags.py), plus --config and --api-key."""
    command = with_config_options(command)
    command = click.option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                           help="Bearer key every HTTP route but /health needs (prefer the "
                                "environment variable: a flag is visible to `ps`).")(command)
    return click.option("--config", "config_path", type=click.Path(dir_okay=False),
                        help="TOML file; keys named as these flags, flags win.")(command)


@click.command()
@_serve_flags
def serve(config_path: str | None, api_key: str | None, **flags: Any) -> None:
    """Serve a GGUF model over an OpenAI-compatible HTTP API and a ZMQ client API."""
    try:
        file_values = load_toml(config_path) if config_path else {}
        config = build_config(file_values, {k: v for k, v in flags.items() if v is not None})
        gguf = GGUFFile(resolve_model(config.model.model))
        model = ModelInfo.from_gguf(gguf)
        check_model_file(gguf, model)
        check_weight_types(gguf, config.model.weights, config.model.device)
        check_draft_model(config, model)
        if config.server.zmq_curve_secret_key:
            read_secret_key(config.server.zmq_curve_secret_key)
        # for the banner; the frontend resolves the same from the same config and file
        sampling = SamplingDefaults.resolve(config.sampling.given(), model_sampling_defaults(gguf))
    except (ConfigError, GGUFError, ValueError) as exc:
        _fail(str(exc))
    os.environ.pop(API_KEY_ENV, None)  # only the frontend's environment will hold the key
    sys.exit(run_server(config, model, api_key=api_key or "", sampling=sampling))


def run_server(config: ServeConfig, model: ModelInfo, *, api_key: str = "",
               sampling: SamplingDefaults | None = None) -> int:
    stop = StopFlag()
    signal.signal(signal.SIGINT, stop.set)
    signal.signal(signal.SIGTERM, stop.set)
    try:
        launcher = make_launcher(config, model, api_key)
        deployment = launcher.start()
    except (LaunchError, ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    click.echo(banner(config, deployment, sampling), err=True)
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
    """The Launcher with the placement `launcher` names: local processes, or Ray actors."""
    if config.server.launcher == "ray":
        from justapi.cluster.placement import RayPlacement  # Ray is an optional extra

        return Launcher(config, model, RayPlacement(config, model), api_key=api_key)
    return Launcher(config, model, api_key=api_key)


def _publish(deployment: Deployment) -> str:
    """Make this server discoverable by the ops commands (justapi/launch/discovery.py); '' if it cannot be."""
    endpoints = deployment.endpoints
    record = discovery.ServerRecord(pid=os.getpid(), admin=endpoints.admin,
                                    client=deployment.zmq_url, http_url=deployment.http_url,
                                    model=deployment.model.name, runtime_dir=endpoints.runtime_dir)
    try:
        return discovery.publish(record)
    except (OSError, discovery.DiscoveryError) as exc:
        click.echo(f"justapi: warning: the ops commands cannot find this server without --admin ({exc})",
                   err=True)
        return ""


def banner(config: ServeConfig, deployment: Deployment,
           sampling: SamplingDefaults | None = None) -> str:
    m, pool = deployment.model, deployment.pool
    if pool.get("kind") == "hosts":  # --launcher ray: a pool per host
        pool_text = "; ".join(_host_text(row) for row in pool["hosts"])
    elif pool:
        dtype = pool.get("dtype", "float32")
        per_token = m.kv_bytes_per_token(DTYPE_BYTES[dtype])
        pool_text = (f"{pool['num_blocks']} blocks x {pool['block_size']} tokens, "
                     f"{pool['num_blocks'] * per_token * pool['block_size'] / 2**20:.0f} MiB {dtype}"
                     " shared by the CPU workers")
    else:
        pool_text = "one pool per GPU worker (sized on the device)"
    lines = [
        f"justapi: model {m.name} ({m.architecture}, {m.num_layers} layers, context "
        f"{m.context_length}) from {m.path}",
        f"justapi: {config.server.workers} worker(s) on {config.model.device}, weights "
        f"{config.model.weights}; KV pool {pool_text}",
        *_pd_lines(config),
        *([f"justapi: sampling defaults for fields a request leaves out: {sampling.describe()}"]
          if sampling else []),
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
