"""A standby scheduler waits for the launcher's line on its stdin: a restart count promotes it;
EOF (the launcher closed the pipe), anything else, or SIGTERM's flag stops it."""
from __future__ import annotations

import os
import threading

from justapi.launch.child import StopFlag
from justapi.scheduler.standby import wait_for_takeover


def _wait_with(data: bytes | None, stop: StopFlag | None = None) -> int | None:
    read_fd, write_fd = os.pipe()
    if data is not None:
        os.write(write_fd, data)
    if data is not None or stop is None:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as stream:
        result = wait_for_takeover(stop or StopFlag(), stream)
    if data is None and stop is not None:
        os.close(write_fd)
    return result


def test_a_count_promotes_it() -> None:
    assert _wait_with(b"3\n") == 3


def test_eof_or_a_bad_line_stops_it() -> None:
    assert _wait_with(b"") is None
    assert _wait_with(b"take over\n") is None


def test_sigterm_stops_the_wait() -> None:
    stop = StopFlag()
    threading.Timer(0.3, stop.set).start()
    assert _wait_with(None, stop) is None
