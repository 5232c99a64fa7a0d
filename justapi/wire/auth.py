"""CURVE on the two tcp:// endpoints: the client endpoint's key files, and the scheduler's
worker endpoint (launcher = "ray"), where only keys the launcher authorized get in.

Client endpoint (`--zmq tcp://0.0.0.0:5555 --zmq-curve-secret-key FILE`): the server's z85
secret key lives in a file only its owner may read (`write_key_pair` makes one per
deployment, `justapi keys`); it travels to the frontend as the file's path, never as a
value on a command line. Clients get the matching public key.

Worker endpoint: keys are made per deployment and secret keys never travel. The launcher
makes the scheduler's pair (secret key in a 0600 file in the 0700 runtime dir, read by the
scheduler on the same host; the public key goes to the workers); each worker makes its own
pair where it runs and hands out only the public key, which the launcher writes to the
authorized-keys file. The scheduler's ZAP handler (pyzmq's ThreadAuthenticator) checks every
new connection against that file (re-read when it changes): an unknown key is refused, and
logged, before any message of it is read; an admitted key speaks only for the worker it was
admitted as (ids.py names it). The same codec frames travel inside, no pickle.
Owns: the key files and their checks, the authenticator, both ends' socket set-up.
Does not own: messages (protocol.py, codec.py), sockets in general (transport.py).
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from justapi.config.sections import ConfigError
from justapi.wire import transport
from justapi.wire.ids import HEARTBEAT_SUFFIX

logger = logging.getLogger(__name__)

Z85_KEY_CHARS = 40
SERVER_KEY_FILE = "workers-server.key"
AUTHORIZED_KEYS_FILE = "workers.keys"


# ---------------------------------------------------------------------- key files
def write_secret_key(path: str, secret_key: bytes) -> None:
    """A z85 secret key in a new file only its owner can read (refused if it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret_key + b"\n")


# ---------------------------------------------------------------------- client endpoint
def write_key_pair(secret_path: str) -> tuple[str, str]:
    """A fresh key pair: the secret key in `secret_path` (mode 0600, refused if it exists),
    the public key in `secret_path + '.pub'`. Returns both paths."""
    public, secret = zmq.curve_keypair()
    write_secret_key(secret_path, secret)
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


# ---------------------------------------------------------------------- worker endpoint
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
        if name and len(key) == Z85_KEY_CHARS:
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
    identity = frames[0].bytes.decode(errors="replace").removesuffix(HEARTBEAT_SUFFIX)
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
