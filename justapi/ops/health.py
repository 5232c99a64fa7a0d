"""`justapi health`: a running server's health table: the verdict and what is wrong, each
worker's heartbeat, step in flight, process figures and KV pool state, and the NVML figures
of its GPU where there is one (temperature, memory, utilisation, power, throttling, ECC, XIDs).

Exit codes: 0 healthy, 1 unhealthy, 2 server not reachable (usable as a probe).
Owns: the health view. Does not own: the verdicts (justapi/health/table.py, justapi/health/watch.py).
"""
from __future__ import annotations

import sys

import click

from justapi.ops.admin_cli import (
    EXIT_FAILED,
    EXIT_OK,
    admin_options,
    human_bytes,
    print_json,
    run,
    seconds,
    table,
)
from justapi.ops.admin_client import AdminClient
from justapi.wire.protocol import StatusReply

PROG = "justapi health"


def render(reply: StatusReply) -> str:
    verdict = "healthy" if reply.healthy else "UNHEALTHY"
    lines = [f"{verdict}; NVML: {reply.nvml or 'not polled yet'}"]
    lines += [f"problem: {p}" for p in reply.problems] + [f"warning: {w}" for w in reply.warnings]
    lines += ["", table(
        ["worker", "pool", "pid", "device", "healthy", "heartbeat", "step in flight", "restarts",
         "RSS", "CPU s", "KV pool", "reason"],
        [[w["worker_id"], w["pool_id"], w.get("pid"), w.get("device"), w["healthy"],
          seconds(w.get("heartbeat_age_s")), seconds(w.get("step_age_s")) if w.get("step_age_s")
          else None, w.get("num_restarts"), human_bytes(w.get("rss_bytes")), w.get("cpu_time_s"),
          _pool_state(w.get("pool") or {}), w.get("reason") or None] for w in reply.workers])]
    if reply.gpus:
        lines += ["", table(
            ["gpu", "name", "temp C", "slowdown C", "memory used", "memory total", "util %",
             "power W", "limit W", "throttle", "ECC corr", "ECC uncorr", "XIDs"],
            [[f"cuda:{g['cuda_index']}", g.get("name") or None, g.get("temperature_c"),
              g.get("slowdown_temperature_c"), human_bytes(g.get("memory_used_bytes")),
              human_bytes(g.get("memory_total_bytes")), g.get("utilization_percent"),
              g.get("power_watts"), g.get("power_limit_watts"),
              ",".join(g.get("throttle_reasons") or []) or None, g.get("ecc_corrected"),
              g.get("ecc_uncorrected"), ",".join(map(str, g.get("xids") or [])) or None]
             for g in reply.gpus])]
    return "\n".join(lines)


def _pool_state(pool: dict) -> str | None:
    if not pool:
        return None
    state = f"{pool.get('kind', '?')} {pool.get('num_blocks', '?')} blocks"
    if pool.get("is_mapped") is False:
        state += " UNMAPPED"
    if pool.get("is_linked") is False:
        state += " UNLINKED"
    return state


@click.command("health")
@admin_options
def health(admin: str | None, timeout_s: float, as_json: bool) -> None:
    """Show a running server's health table (NVML too on GPUs).

    Each worker's verdict, heartbeat, step in flight, process figures and KV pool state, and
    the NVML figures of its GPU where there is one.

    Exit status: 0 healthy, 1 unhealthy, 2 server not reachable (usable as a probe).
    """
    def action(client: AdminClient) -> int:
        reply = client.status()
        if as_json:
            print_json({"healthy": reply.healthy, "problems": reply.problems,
                        "warnings": reply.warnings, "nvml": reply.nvml,
                        "workers": reply.workers, "gpus": reply.gpus})
        else:
            click.echo(render(reply))
        return EXIT_OK if reply.healthy else EXIT_FAILED

    sys.exit(run(PROG, action, admin, timeout_s))
