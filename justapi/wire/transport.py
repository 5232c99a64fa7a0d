"""ZeroMQ plumbing: endpoints in a private runtime dir, and sockets that speak the codec.

Every message is `codec.encode` frames (orjson header + raw numpy frames, zero-copy on send);
ROUTER sockets prepend the peer identity. Malformed input is logged and dropped by the
caller's loop; nothing is ever unpickled.
Owns: socket creation, endpoint naming, runtime-dir lifetime. Does not own: message meaning.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Callable

import zmq

from justapi.wire.codec import ProtocolError, decode, encode

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # zmq drops larger inbound messages outright


def make_runtime_dir(prefix: str = "justapi-") -> str:
    """A fresh private directory (mode 0700) for ipc sockets; the launcher removes it."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o700)
    return path


def remove_runtime_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ipc_endpoint(runtime_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(runtime_dir, name)}.sock"


def is_loopback_endpoint(endpoint: str) -> bool:
    if endpoint.startswith("ipc://") or endpoint.startswith("inproc://"):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def make_socket(context: zmq.Context, kind: int, endpoint: str, *, bind: bool,
                identity: bytes | None = None, curve_secret_key: bytes | None = None,
                curve_server_key: bytes | None = None,
                socket_class: type[zmq.Socket] | None = None) -> zmq.Socket:
    """A socket with sane defaults: no linger on close, bounded inbound message size.

    CURVE (remote tcp:// clients): a server passes its secret key (z85); a client passes
    the server's public key (and its own secret key, or a fresh pair is made).
    socket_class: a zmq.Socket subclass (justapi/wire/auth.py checks senders' keys)."""
    sock = context.socket(kind, socket_class=socket_class)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve_server_key is not None:
        secret = curve_secret_key or zmq.curve_keypair()[1]
        sock.curve_secretkey, sock.curve_publickey = secret, zmq.curve_public(secret)
        sock.curve_serverkey = curve_server_key
    elif curve_secret_key is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve_secret_key
        sock.curve_publickey = zmq.curve_public(curve_secret_key)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, message: Any, *, to: bytes | None = None, flags: int = 0) -> None:
    frames = encode(message)
    if to is not None:
        frames = [to, *frames]
    sock.send_multipart(frames, flags=flags, copy=False)


def recv(sock: zmq.Socket, *, routed: bool = False, flags: int = 0) -> tuple[bytes | None, Any]:
    """Receive one message -> (sender identity or None, decoded message).

    Raises ProtocolError for anything that does not decode (the caller logs and drops it)."""
    frames = sock.recv_multipart(flags=flags, copy=False)
    sender = None
    if routed:
        if len(frames) < 2:
            raise ProtocolError("routed message without a body")
        sender = bytes(frames[0].buffer)
        frames = frames[1:]
    return sender, decode(frames)


def drain(sock: zmq.Socket, *, routed: bool = False, limit: int = 10_000,
          on_malformed: Callable[[ProtocolError], None] | None = None) -> list[tuple[bytes | None, Any]]:
    """Every message waiting on `sock` (non-blocking); malformed ones are logged and dropped
    (and handed to on_malformed, which may answer them: a worker refuses a step it cannot read)."""
    out: list[tuple[bytes | None, Any]] = []
    # EVENTS first: a receive on an empty socket raises zmq.Again, whose construction costs a
    # loop of the scheduler (several sockets drained per step) ~20 us a step at batch 1
    while len(out) < limit and int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
        try:
            out.append(recv(sock, routed=routed, flags=zmq.NOBLOCK))
        except zmq.Again:
            break
        except ProtocolError as exc:
            logger.warning("dropped malformed message: %s", exc)
            if on_malformed is not None:
                on_malformed(exc)
    return out
