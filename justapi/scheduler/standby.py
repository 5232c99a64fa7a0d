"""A scheduler started ahead of need (restart-scheduler): it has imported everything and loaded
the model's tokenizer - most of a scheduler's start-up - and waits, holding no socket, until
the launcher promotes it after the scheduler's death with one line on its stdin (the pool's
restart count). Its take-over then costs the attach of the workers and an empty core.

    launcher: spawn standby (stdin = pipe) ... scheduler dies -> write "N\\n" -> spawn the next
    standby:  imports, tokenizer -> wait -> SchedulerProcess (num_restarts N) -> serve

Owns: the standby's wait. Does not own: when a standby is started or promoted (launcher.py).
"""
from __future__ import annotations

import logging
import os
import select
import sys
from typing import IO

from justapi.launch.child import StopFlag

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the wait looks at the stop flag (SIGTERM)


def wait_for_takeover(stop: StopFlag, stream: IO[bytes] | None = None) -> int | None:
    """Block until the launcher's line; its restart count, or None when the standby is to
    stop (SIGTERM, the launcher's end of the pipe closed, a line that is not a count)."""
    source = stream if stream is not None else sys.stdin.buffer
    fd = source.fileno()
    while not stop.is_set:
        readable, _, _ = select.select([fd], [], [], POLL_S)
        if not readable:
            continue
        line = _read_line(fd)
        if not line.strip().isdigit():
            if line:
                logger.error("standby scheduler: ignored order %r; stopping", line[:40])
            return None
        return int(line)
    return None


def _read_line(fd: int) -> bytes:
    """Bytes up to a newline (or EOF), read unbuffered: select() saw them in the pipe."""
    out = b""
    while not out.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            break
        out += chunk
    return out
