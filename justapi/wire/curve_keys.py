"""CURVE key files for the ZMQ client endpoint: make a pair, read a secret key safely.

A `tcp://` client endpoint that other hosts can reach must be encrypted and authenticated:
`justapi serve --zmq tcp://0.0.0.0:5555 --zmq-curve-secret-key FILE` (the server's z85
secret key, a file only its owner may read); clients get the matching public key.
`write_key_pair` makes one per deployment (`justapi keys`). The key travels to the
frontend as the file's path, never as a value on a command line.
Owns: the key file format and its checks. Does not own: sockets (transport.py).
"""
from __future__ import annotations

import os
import stat

import zmq

from justapi.config.sections import ConfigError

Z85_KEY_CHARS = 40


def write_key_pair(secret_path: str) -> tuple[str, str]:
    """A fresh key pair: the secret key in `secret_path` (mode 0600, refused if it exists),
    the public key in `secret_path + '.pub'`. Returns both paths."""
    public, secret = zmq.curve_keypair()
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret + b"\n")
    public_path = secret_path + ".pub"
    with open(public_path, "wb") as handle:
        handle.write(public + b"\n")
    return secret_path, public_path


def read_secret_key(path: str) -> bytes:
    """The z85 secret key in `path`; ConfigError (one line naming the file) if it is missing,
    readable by others, or not a key."""
    try:
        info = os.stat(path)
        with open(path, "rb") as handle:
            key = handle.read(4 * Z85_KEY_CHARS).strip()
    except OSError as exc:
        raise ConfigError(f"zmq-curve-secret-key {path}: cannot read ({exc.strerror})") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"zmq-curve-secret-key {path}: mode {stat.S_IMODE(info.st_mode):o} "
                          "lets other users read the secret key (chmod 600 it)")
    if len(key) != Z85_KEY_CHARS:
        raise ConfigError(f"zmq-curve-secret-key {path}: not a z85 CURVE secret key "
                          f"({Z85_KEY_CHARS} characters expected, found {len(key)})")
    try:
        zmq.curve_public(key)
    except (ValueError, zmq.ZMQError):
        raise ConfigError(f"zmq-curve-secret-key {path}: not a z85 CURVE secret key") from None
    return key


def public_key_of(secret_key: bytes) -> bytes:
    return zmq.curve_public(secret_key)
