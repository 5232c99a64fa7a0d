"""CURVE on the scheduler's worker endpoint (launcher = "ray"): workers on other hosts connect
over tcp://, encrypted, and only keys the launcher authorized get in.

Keys are made per deployment and secret keys never travel: the launcher makes the
scheduler's pair (secret key in a 0600 file in the 0700 runtime dir, read by the scheduler on
the same host; the public key goes to the workers), and each worker makes its own pair where
it runs and hands out only the public key, which the launcher writes to the authorized-keys
file. The scheduler's ZAP handler (pyzmq's ThreadAuthenticator) checks every new connection
against that file (re-read when it changes): an unknown key is refused, and logged, before
any message of it is read; an admitted key speaks only for the worker it was admitted as.
The same protocol as ipc travels inside: codec frames, no pickle.
Owns: the key files, the authenticator, both ends' socket set-up. Does not own: messages.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from justapi.wire import transport

logger = logging.getLogger(__name__)

SERVER_KEY_FILE = "workers-server.key"
AUTHORIZED_KEYS_FILE = "workers.keys"


def write_secret_key(path: str, secret_key: bytes) -> None:
    """A z85 secret key in a new file only its owner can read (refused if it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret_key + b"\n")


def read_key_file(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read().strip()


def write_authorized_keys(path: str, keys: dict[str, bytes]) -> None:
    """name -> z85 public key, one `name key` line each; replaced atomically."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        for name, key in sorted(keys.items()):
            handle.write(f"{name} {key.decode()}\n")
    os.replace(tmp, path)


def read_authorized_keys(path: str) -> dict[bytes, str]:
    """z85 public key -> name; {} when the file does not exist yet."""
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return {}
    out: dict[bytes, str] = {}
    for line in lines:
        name, _, key = line.strip().partition(" ")
        if name and len(key) == 40:
            out[key.encode()] = name
    return out


class WorkerKeyCheck:
    """ZAP credentials provider: is this CURVE key one of the deployment's workers?"""

    def __init__(self, path: str) -> None:
        self.path = path
        self._keys: dict[bytes, str] = {}
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()  # the ZAP thread asks, the scheduler thread may read

    def callback(self, domain: str, key: bytes) -> bool:
        name = self.name_of(key)
        if name is None:
            logger.warning("refused a worker connection: CURVE key %s... is not one of this "
                           "deployment's workers", key[:8].decode(errors="replace"))
        return name is not None

    def name_of(self, key: bytes) -> str | None:
        with self._lock:
            self._refresh()
            return self._keys.get(key)

    def _refresh(self) -> None:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return
        stamp = (info.st_mtime_ns, info.st_ino)
        if stamp != self._stamp:
            self._keys, self._stamp = read_authorized_keys(self.path), stamp


class WorkerRouter(zmq.Socket):
    """The scheduler's worker ROUTER: a message counts only when its routing identity
    (`worker-N`, or `worker-N-heartbeat`) is the name the sender's CURVE key was admitted as
    (its ZAP User-Id); others are dropped and logged, so one admitted worker cannot speak
    for another."""

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        while True:
            frames = super().recv_multipart(flags, copy=False, track=track)
            if _is_own(frames):
                return frames if not copy else [frame.bytes for frame in frames]


def _is_own(frames: list[zmq.Frame]) -> bool:
    if len(frames) < 2:
        return True  # malformed: the codec drops it
    identity = frames[0].bytes.decode(errors="replace").removesuffix("-heartbeat")
    try:
        user = frames[1].get("User-Id")
    except zmq.ZMQError:
        user = None
    if user == identity:
        return True
    logger.warning("dropped a message from %r: its CURVE key was admitted as %r", identity, user)
    return False


class WorkerAuthenticator(ThreadAuthenticator):
    """ZAP in a thread of the scheduler process; a connection's User-Id is its worker's name."""

    def __init__(self, context: zmq.Context, check: WorkerKeyCheck) -> None:
        super().__init__(context)
        self.check = check

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = zmq.utils.z85.encode(client_public_key)
        return self.check.name_of(key) or key.decode()


def bind_worker_socket(context: zmq.Context, endpoint: str, secret_key: bytes,
                       authorized_keys_path: str) -> tuple[zmq.Socket, WorkerAuthenticator]:
    """The scheduler's CURVE ROUTER, its ZAP handler started first (without one, libzmq would
    let any key in)."""
    check = WorkerKeyCheck(authorized_keys_path)
    auth = WorkerAuthenticator(context, check)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=check)
    try:
        sock = transport.make_socket(context, zmq.ROUTER, endpoint, bind=True,
                                     curve_secret_key=secret_key, socket_class=WorkerRouter)
    except BaseException:
        auth.stop()
        raise
    return sock, auth


def connect_worker_socket(context: zmq.Context, endpoint: str, identity: bytes,
                          secret_key: bytes, server_public_key: bytes) -> zmq.Socket:
    """A worker's DEALER to the scheduler: its own key pair, the scheduler's public key."""
    return transport.make_socket(context, zmq.DEALER, endpoint, bind=False, identity=identity,
                                 curve_secret_key=secret_key, curve_server_key=server_public_key)
