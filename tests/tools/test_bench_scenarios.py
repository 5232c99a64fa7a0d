"""`python -m tools.bench <scenario>`: the scenario list, an unknown scenario, every scenario's
module importing as a package module (no sys.path edits) with its flags and `--help`, and a
torch-free scenario run end to end from the repository root."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.__main__ import SCENARIOS, main, module_name

ROOT = Path(__file__).resolve().parents[2]


def test_the_list_and_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out.split("scenarios:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == list(SCENARIOS)
    assert main(["nope"]) == 2
    assert capsys.readouterr().err.startswith("python -m tools.bench: unknown scenario 'nope'")
    assert main([]) == 2 and "usage: python -m tools.bench SCENARIO" in capsys.readouterr().err


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_scenario_has_help(scenario: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(module_name(scenario))
    with pytest.raises(SystemExit) as exit_info:
        main([scenario, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m tools.bench {scenario} ")
    assert module.__doc__  # each scenario says what it measures


def test_a_scenario_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench", "scheduler", "--only", "step", "--running", "8",
         "--waiting", "50", "--steps", "3", "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("step cost, 8 running / 50 waiting on 1 worker(s)")
    assert lines[1].strip() == "sequences per round: mean 8.0; still waiting 50; preemptions 0"
    assert [line.split()[0] for line in lines[2:5]] == ["schedule", "update", "schedule+update"]
