"""`justapi status`: a running server's state: workers (pool, health, load, KV usage), hosts
(--launcher ray), queues per pool, prefix-cache statistics and request totals, from the
scheduler's admin socket.

Exit codes: 0 healthy, 1 unhealthy (or an invariant violated), 2 server not reachable.
Owns: the status view. Does not own: the figures (justapi/scheduler/stats.py, justapi/health/table.py).
"""
from __future__ import annotations

import sys
from dataclasses import asdict

import click

from justapi.ops.admin_cli import (
    EXIT_FAILED,
    EXIT_OK,
    admin_options,
    human_bytes,
    percent,
    print_json,
    run,
    seconds,
    table,
)
from justapi.ops.admin_client import AdminClient
from justapi.wire.protocol import StatusReply

PROG = "justapi status"


def render(reply: StatusReply, endpoint: str) -> str:
    stats = reply.stats
    verdict = "healthy" if reply.healthy else "UNHEALTHY"
    lines = [f"server {endpoint}  up {seconds(reply.uptime_s)}  {verdict}"]
    lines += [f"problem: {p}" for p in reply.problems] + [f"warning: {w}" for w in reply.warnings]
    lines += ["", "workers", table(
        ["id", "pool", "pid", "device", "health", "draining", "running", "busy", "pool KV use",
         "RSS", "heartbeat"],
        [[w["worker_id"], w["pool_id"], w.get("pid"), w.get("device"),
          "ok" if w["healthy"] else f"DOWN: {w.get('reason', '')}", w.get("draining"),
          w.get("num_requests_running"), w.get("busy"),
          percent(stats.get(f"pool_{w['pool_id']}_kv_usage")), human_bytes(w.get("rss_bytes")),
          seconds(w.get("heartbeat_age_s"))] for w in reply.workers])]
    lines += _hosts_table(reply.workers)
    pool_ids = sorted({w["pool_id"] for w in reply.workers})
    lines += ["", "queues", table(
        ["pool", "waiting", "running", "KV use", "free blocks", "cached blocks"],
        [[p, _int(stats.get(f"pool_{p}_num_requests_waiting")),
          _int(stats.get(f"pool_{p}_num_requests_running")),
          percent(stats.get(f"pool_{p}_kv_usage")), _int(stats.get(f"pool_{p}_kv_blocks_free")),
          _int(stats.get(f"pool_{p}_prefix_cache_blocks"))] for p in pool_ids])]
    lines += ["", "prefix cache", _cache_line(stats), "", "totals", _totals_line(stats)]
    return "\n".join(lines)


def _hosts_table(workers: list[dict]) -> list[str]:
    """--launcher ray: which host runs which workers (and their pools), and how many are up."""
    hosts: dict[str, list[dict]] = {}
    for worker in workers:
        if worker.get("host"):
            hosts.setdefault(str(worker["host"]), []).append(worker)
    if not hosts:
        return []
    rows = [[host, ", ".join(str(w["worker_id"]) for w in rows),
             ", ".join(sorted({str(w["pool_id"]) for w in rows})),
             f"{sum(bool(w['healthy']) for w in rows)}/{len(rows)}",
             "ok" if any(w["healthy"] for w in rows) else "LOST"]
            for host, rows in sorted(hosts.items())]
    return ["", "hosts", table(["host", "workers", "pools", "healthy", "state"], rows)]


def _cache_line(stats: dict) -> str:
    hits, misses = _int(stats.get("prefix_cache_hits")), _int(stats.get("prefix_cache_misses"))
    return (f"  {hits} block hits / {misses} misses (hit ratio "
            f"{stats.get('prefix_cache_hit_ratio', 0.0):.3f}); "
            f"{_int(stats.get('prefix_cache_blocks'))} blocks cached; "
            f"{_int(stats.get('prefix_cache_hit_tokens'))} of "
            f"{_int(stats.get('prefix_cache_query_tokens'))} prompt tokens served from cache; "
            f"KV blocks {_int(stats.get('kv_blocks_in_use'))} in use / "
            f"{_int(stats.get('kv_blocks_total'))}")


def _totals_line(stats: dict) -> str:
    return (f"  requests {_int(stats.get('num_requests'))}, finished "
            f"{_int(stats.get('num_finished'))} (aborted {_int(stats.get('num_aborted'))}, "
            f"errors {_int(stats.get('num_errors'))}), preemptions "
            f"{_int(stats.get('num_preemptions'))}, steps {_int(stats.get('num_steps'))}, "
            f"generated tokens {_int(stats.get('num_generated_tokens'))}")


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


@click.command("status")
@admin_options
@click.option("--check-invariants", is_flag=True,
              help="Also run the scheduler's full consistency check (blocks, requests).")
def status(admin: str | None, timeout_s: float, as_json: bool, check_invariants: bool) -> None:
    """Show a running server's workers, queues and prefix cache.

    Also hosts (--launcher ray) and request totals, from the scheduler's admin socket.

    Exit status: 0 healthy, 1 unhealthy (or an invariant violated), 2 server not reachable.
    """
    def action(client: AdminClient) -> int:
        reply = client.status()
        check = client.check_invariants() if check_invariants else None
        if as_json:
            print_json({"status": asdict(reply), "invariants": asdict(check) if check else None})
        else:
            click.echo(render(reply, client.endpoint))
            if check is not None:
                click.echo(f"\ninvariants: {check.message}")
        if check is not None and not check.ok:
            return EXIT_FAILED
        return EXIT_OK if reply.healthy else EXIT_FAILED

    sys.exit(run(PROG, action, admin, timeout_s))
