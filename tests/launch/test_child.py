"""start_child: the frontend and the scheduler take the configured niceness in their own
process; workers keep theirs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from justapi.config.serve import build_config
from justapi.launch.child import ChildSpec, Endpoints

START = r"""
import os, sys
from justapi.launch.child import start_child
start_child([sys.argv[1]])
print(os.nice(0))
"""


def niceness_after_start(role: str, cli: dict) -> int:
    spec = ChildSpec(role, 0, build_config({}, cli), Endpoints.in_dir("/tmp/x"), "")
    out = subprocess.run([sys.executable, "-c", START, spec.to_json()], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return int(out.stdout.strip())


@pytest.mark.parametrize("role, cli, added", [
    ("frontend", {"control_nice": 7}, 7),
    ("scheduler", {"control_nice": 7}, 7),
    ("worker", {"control_nice": 7}, 0),
    ("scheduler", {"control_nice": 0}, 0),
])
def test_control_processes_lower_their_own_priority(role, cli, added):
    assert niceness_after_start(role, cli) == min(19, os.nice(0) + added)  # 19: the ceiling
