"""`justapi flush-cache`: flush a running server's prefix cache: evict every cached KV block
that no request holds (blocks of running requests stay), in every pool or in one, through the
admin socket.

Exit codes: 0 flushed, 1 refused (unknown pool), 2 server not reachable.
Owns: the flush command line. Does not own: eviction (RadixPrefixCache.flush).
"""
from __future__ import annotations

import sys

import click

from justapi.ops.admin_cli import EXIT_FAILED, EXIT_OK, admin_options, print_json, run
from justapi.ops.admin_client import AdminClient

PROG = "justapi flush-cache"


@click.command("flush-cache")
@click.option("--pool", "pool_id", type=int, default=-1, metavar="POOL_ID",
              help="Flush only this pool (default: every pool).")
@admin_options
def flush_cache(pool_id: int, admin: str | None, timeout_s: float, as_json: bool) -> None:
    """Flush the prefix cache (the blocks no request holds).

    Blocks of running requests stay cached; --pool flushes one pool, else every pool.

    Exit status: 0 flushed, 1 refused (unknown pool), 2 server not reachable.
    """
    def action(client: AdminClient) -> int:
        reply = client.flush_prefix_cache(pool_id)
        if as_json:
            print_json(reply)
        else:
            click.echo(reply.message)
        return EXIT_OK if reply.ok else EXIT_FAILED

    sys.exit(run(PROG, action, admin, timeout_s))
