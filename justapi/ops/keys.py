"""`justapi keys SECRET_FILE`: make a CURVE key pair for the ZMQ client endpoint of one deployment.

Writes the server's z85 secret key to SECRET_FILE (mode 0600; an existing file is never
overwritten) and its public key to SECRET_FILE.pub, then prints the public key. Start the
server with `justapi serve --zmq tcp://0.0.0.0:5555 --zmq-curve-secret-key SECRET_FILE` and
give clients the public key: `Client("tcp://host:5555", server_public_key=b"...")`.
Owns: this command line. Does not own: the key format (justapi/wire/auth.py).
"""
from __future__ import annotations

import sys

import click

from justapi.wire.auth import write_key_pair

PROG = "justapi keys"


@click.command("keys")
@click.argument("secret_file", metavar="SECRET_FILE")
def keys(secret_file: str) -> None:
    """Make a CURVE key pair for the ZMQ client endpoint.

    Writes SECRET_FILE (mode 0600; must not exist) and SECRET_FILE.pub.

    Start the server with `--zmq tcp://0.0.0.0:5555 --zmq-curve-secret-key SECRET_FILE` and
    give clients the public key it prints. Exit status 2 when the file cannot be written.
    """
    try:
        secret_path, public_path = write_key_pair(secret_file)
    except OSError as exc:
        click.echo(f"{PROG}: cannot write {secret_file}: {exc.strerror}", err=True)
        sys.exit(2)
    with open(public_path) as handle:
        public = handle.read().strip()
    click.echo(f"secret key: {secret_path} (mode 0600, for --zmq-curve-secret-key)")
    click.echo(f"public key: {public_path}: {public}")
