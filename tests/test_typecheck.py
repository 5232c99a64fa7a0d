"""mypy over the product and its tools (setup.cfg's [mypy] section): a wrong type in a call
between modules, a missing Optional check or a protocol a class no longer meets fails here.
tests/ is left out: its fakes are duck-typed stand-ins for the real classes on purpose."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_mypy_is_clean(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
         "justapi", "workers", "tools"],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, f"mypy found errors:\n{result.stdout}{result.stderr}"
