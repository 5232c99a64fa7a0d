"""Flush a running server's prefix cache: evict every cached KV block that no request holds
(blocks of running requests stay), in every pool or in one, through the admin socket.

Usage: python tools/flush_cache.py [--pool POOL_ID] [--admin ENDPOINT] [--json]
Exit codes: 0 flushed, 1 refused (unknown pool), 2 server not reachable.
Owns: the flush command line. Does not own: eviction (RadixPrefixCache.flush).
"""
from __future__ import annotations

import sys

from ops_cli import EXIT_FAILED, EXIT_OK, parser, print_json, run

from justapi.ops.admin_client import AdminClient

PROG = "flush_cache.py"


def main(argv: list[str] | None = None) -> int:
    cli = parser(PROG, __doc__.split("\n\n")[0])
    cli.add_argument("--pool", type=int, default=-1, metavar="POOL_ID",
                     help="flush only this pool (default: every pool)")
    args = cli.parse_args(argv)

    def action(client: AdminClient) -> int:
        reply = client.flush_prefix_cache(args.pool)
        if args.json:
            print_json(reply)
        else:
            print(reply.message)
        return EXIT_OK if reply.ok else EXIT_FAILED

    return run(PROG, action, args)


if __name__ == "__main__":
    sys.exit(main())
