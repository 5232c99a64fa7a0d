"""Make a CURVE key pair for the ZMQ client endpoint of one deployment.

Usage: python tools/curve_keys.py SECRET_FILE
Writes the server's z85 secret key to SECRET_FILE (mode 0600; an existing file is never
overwritten) and its public key to SECRET_FILE.pub, then prints the public key. Start the
server with `justapi serve --zmq tcp://0.0.0.0:5555 --zmq-curve-secret-key SECRET_FILE` and
give clients the public key: `Client("tcp://host:5555", server_public_key=b"...")`.
Owns: this command line. Does not own: the key format (justapi/wire/auth.py).
"""
from __future__ import annotations

import argparse
import sys

from justapi.wire.auth import write_key_pair

PROG = "curve_keys.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("secret_file", help="where to write the secret key (must not exist)")
    args = parser.parse_args(argv)
    try:
        secret_path, public_path = write_key_pair(args.secret_file)
    except OSError as exc:
        print(f"{PROG}: cannot write {args.secret_file}: {exc.strerror}", file=sys.stderr)
        return 2
    with open(public_path) as handle:
        public = handle.read().strip()
    print(f"secret key: {secret_path} (mode 0600, for --zmq-curve-secret-key)")
    print(f"public key: {public_path}: {public}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
