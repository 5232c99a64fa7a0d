"""`justapi drain WORKER_ID`: drain a worker (it admits no new requests; the ones it runs
finish) or undrain it, through the scheduler's admin socket. With --wait, return once the
drained worker runs nothing.

Exit codes: 0 done, 1 refused (unknown worker) or --wait timed out, 2 server not reachable.
Owns: the drain command line. Does not own: what draining does (Scheduler.set_draining).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict

import click

from justapi.ops.admin_cli import EXIT_FAILED, EXIT_OK, admin_options, print_json, run
from justapi.ops.admin_client import AdminClient

PROG = "justapi drain"
WAIT_POLL_S = 0.2


def wait_until_idle(client: AdminClient, worker_id: int, timeout_s: float) -> int | None:
    """Poll the worker's running count until it is 0; the count left at the timeout, or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [w for w in client.status().workers if w["worker_id"] == worker_id]
        running = int(rows[0].get("num_requests_running", 0)) if rows else 0
        if running == 0:
            return None
        if time.monotonic() >= deadline:
            return running
        time.sleep(WAIT_POLL_S)


@click.command("drain")
@click.argument("worker_id", type=int, metavar="WORKER_ID")
@click.option("--undrain", is_flag=True, help="Let the worker admit requests again.")
@click.option("--wait", is_flag=True, help="After draining, wait until the worker runs no request.")
@click.option("--wait-timeout", "wait_timeout_s", type=float, default=600.0, metavar="SECONDS",
              show_default=True, help="How long --wait waits.")
@admin_options
def drain(worker_id: int, undrain: bool, wait: bool, wait_timeout_s: float, admin: str | None,
          timeout_s: float, as_json: bool) -> None:
    """Drain a worker (no new requests), or undrain it.

    A drained worker WORKER_ID admits no new request; the ones it runs finish.

    Exit status: 0 done, 1 refused (unknown worker) or --wait timed out, 2 server not reachable.
    """
    def action(client: AdminClient) -> int:
        reply = client.drain(worker_id, is_draining=not undrain)
        left = None
        if reply.ok and wait and not undrain:
            left = wait_until_idle(client, worker_id, wait_timeout_s)
        if as_json:
            print_json({**asdict(reply), "num_requests_left": left})
        else:
            click.echo(reply.message)
            if reply.ok and wait and not undrain:
                click.echo(f"worker {worker_id}: drained, no request running" if left is None
                           else f"worker {worker_id}: still running {left} request(s) after "
                                f"{wait_timeout_s:g}s")
        return EXIT_OK if reply.ok and left is None else EXIT_FAILED

    sys.exit(run(PROG, action, admin, timeout_s))
