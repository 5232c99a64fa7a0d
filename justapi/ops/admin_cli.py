"""Shared command-line plumbing of the admin commands (`justapi status`, `health`, `drain`,
`flush-cache`): the --admin / --timeout / --json flags, connecting to the server, one-line
errors and exit codes, and plain-text tables (`justapi inspect` uses those too).

Without --admin the commands talk to the most recently started live `justapi serve` of this
user (its state file, see justapi/launch/discovery.py and docs/operations.md).
Owns: how the admin commands look and fail. Does not own: the admin protocol
(justapi/ops/admin_client.py) or what each command shows.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from justapi.ops.admin_client import DEFAULT_TIMEOUT_S, AdminClient, AdminError

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 2
FIND_HELP = ("Admin endpoint of the server, e.g. ipc:///tmp/justapi-xyz/admin.sock "
             "(default: the most recently started live server of this user).")
F = TypeVar("F", bound=Callable[..., Any])


def admin_options(command: F) -> F:
    """The flags every admin command shares: --admin, --timeout, --json."""
    options = [
        click.option("--admin", metavar="ENDPOINT", default=None, help=FIND_HELP),
        click.option("--timeout", "timeout_s", type=float, default=DEFAULT_TIMEOUT_S,
                     metavar="SECONDS", show_default=True,
                     help="How long to wait for the answer."),
        click.option("--json", "as_json", is_flag=True, help="Print the reply as JSON."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run(prog: str, action: Callable[[AdminClient], int], endpoint: str | None,
        timeout_s: float) -> int:
    """Connect, run `action`, close; a server that cannot be reached is one line, exit 2."""
    try:
        with AdminClient(endpoint, timeout_s=timeout_s) as client:
            return action(client)
    except (AdminError, ValueError) as exc:
        click.echo(f"{prog}: error: {exc}", err=True)
        return EXIT_UNREACHABLE


def print_json(message: Any) -> None:
    is_instance = dataclasses.is_dataclass(message) and not isinstance(message, type)
    data = dataclasses.asdict(message) if is_instance else message
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Aligned columns: numbers to the right, text to the left; None shows as '-'."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row[i]) for row in rows) and any(row[i] is not None for row in rows)
               for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers))] + [line(r) for r in cells])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def human_bytes(num_bytes: object) -> str | None:
    if not isinstance(num_bytes, (int, float)) or isinstance(num_bytes, bool):
        return None
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return None


def seconds(value: object) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if value < 60:
        return f"{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def percent(value: object) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return f"{100 * value:.1f}%"
