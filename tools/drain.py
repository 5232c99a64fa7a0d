"""Drain a worker (it admits no new requests; the ones it runs finish) or undrain it, through
the scheduler's admin socket. With --wait, return once the drained worker runs nothing.

Usage: python tools/drain.py WORKER_ID [--undrain] [--wait [--wait-timeout S]] [--admin ENDPOINT]
Exit codes: 0 done, 1 refused (unknown worker) or --wait timed out, 2 server not reachable.
Owns: the drain command line. Does not own: what draining does (Scheduler.set_draining).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict

from ops_cli import EXIT_FAILED, EXIT_OK, parser, print_json, run

from justapi.ops.admin_client import AdminClient

PROG = "drain.py"
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


def main(argv: list[str] | None = None) -> int:
    cli = parser(PROG, __doc__.split("\n\n")[0])
    cli.add_argument("worker_id", type=int, metavar="WORKER_ID", help="the worker to drain")
    cli.add_argument("--undrain", action="store_true", help="let the worker admit requests again")
    cli.add_argument("--wait", action="store_true",
                     help="after draining, wait until the worker runs no request")
    cli.add_argument("--wait-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="how long --wait waits (default 600)")
    args = cli.parse_args(argv)

    def action(client: AdminClient) -> int:
        reply = client.drain(args.worker_id, is_draining=not args.undrain)
        left = None
        if reply.ok and args.wait and not args.undrain:
            left = wait_until_idle(client, args.worker_id, args.wait_timeout)
        if args.json:
            print_json({**asdict(reply), "num_requests_left": left})
        else:
            print(reply.message)
            if reply.ok and args.wait and not args.undrain:
                print(f"worker {args.worker_id}: drained, no request running" if left is None
                      else f"worker {args.worker_id}: still running {left} request(s) after "
                           f"{args.wait_timeout:g}s")
        return EXIT_OK if reply.ok and left is None else EXIT_FAILED

    return run(PROG, action, args)


if __name__ == "__main__":
    sys.exit(main())
