"""Finding a running `justapi serve`: one small JSON state file per server, per user.

`justapi serve` writes `<state dir>/<launcher pid>.json` (its admin and client endpoints,
HTTP URL, model, start time) once every process is ready, and removes it when it stops.
The state dir is $JUSTAPI_STATE_DIR if set, else $XDG_RUNTIME_DIR/justapi, else
/tmp/justapi-<uid>; it is created mode 0700 and must belong to this user. Tools take the
most recently started server whose launcher is still alive; files of dead servers (a
SIGKILLed launcher) are skipped and removed.
Owns: the state file format and location. Does not own: the endpoints (launcher, child.py).
"""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field

STATE_DIR_ENV = "JUSTAPI_STATE_DIR"


class DiscoveryError(RuntimeError):
    """No running server found, or the state dir is unsafe; the message says what to do."""


@dataclass(frozen=True)
class ServerRecord:
    pid: int
    admin: str
    client: str
    http_url: str
    model: str
    runtime_dir: str
    started_at: float = field(default_factory=time.time)

    @property
    def is_alive(self) -> bool:
        """The launcher runs and its runtime dir still exists (guards against pid reuse)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a pid now owned by someone else: not our server
            return False
        return not self.runtime_dir or os.path.isdir(self.runtime_dir)


def state_dir() -> str:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return os.path.join(xdg, "justapi")
    return f"/tmp/justapi-{os.getuid()}"


def _ensure_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise DiscoveryError(f"state dir {path} is not a directory owned by this user; "
                             f"set {STATE_DIR_ENV} to a private directory")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


def publish(record: ServerRecord) -> str:
    """Write the record atomically (mode 0600); returns its path (remove it at shutdown)."""
    directory = state_dir()
    _ensure_private_dir(directory)
    path = os.path.join(directory, f"{record.pid}.json")
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(record), handle)
    os.replace(tmp, path)
    return path


def unpublish(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def running_servers() -> list[ServerRecord]:
    """Live servers of this user, most recently started first; stale files are removed."""
    directory = state_dir()
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        record = _read(path)
        if record is None:
            continue
        if record.is_alive:
            found.append(record)
        else:
            unpublish(path)
    return sorted(found, key=lambda r: r.started_at, reverse=True)


def _read(path: str) -> ServerRecord | None:
    try:
        with open(path) as handle:
            return ServerRecord(**json.load(handle))
    except (OSError, ValueError, TypeError):
        return None  # half-written, or another version's format: not ours to judge


def default_admin_endpoint() -> str:
    """The admin endpoint of the most recently started live server."""
    servers = running_servers()
    if not servers:
        raise DiscoveryError(f"no running justapi server found in {state_dir()} "
                             "(start one with `justapi serve`, or pass --admin ENDPOINT)")
    return servers[0].admin

