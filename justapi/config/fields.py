"""What every config section is built from: `option()`, a dataclass field whose metadata carries
its help text (and its flag's spelling where that is not `--field-name`), and the checks the
sections' `__post_init__` share (`require`, `check_number`), raising ConfigError naming the key.

Owns: ConfigError, FlagSpec and the checks. Does not own: the sections (sections.py, ops.py, ...)
or the click options made from them (flags.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
FLAG_METADATA = "justapi_flag"
"""The metadata key under which a field keeps its FlagSpec."""


class ConfigError(ValueError):
    """A configuration value that is out of range or unknown; the message names the key."""


@dataclass(frozen=True)
class FlagSpec:
    """How a config field appears on `justapi serve`'s command line (and in its --help)."""

    help: str
    """One line or a few: what the value changes. The default is shown from the field."""
    decls: tuple[str, ...] = ()
    """click declarations when not `--field-name` (bools: `--field-name/--no-field-name`)."""
    choices: tuple[str, ...] = ()
    """The values a str field may take (its check names them too)."""
    flag_value: str | None = None
    """A switch that sets this value (`--gpu` sets device to "cuda")."""
    is_path: bool = False
    """A file the flag names (click checks it is not a directory)."""
    internal: bool = False
    """TOML only: no flag."""


def option(default: T, help: str, *, decls: tuple[str, ...] = (), choices: tuple[str, ...] = (),
           flag_value: str | None = None, is_path: bool = False, internal: bool = False) -> T:
    """A dataclass field with its one default and the help text its flag shows."""
    spec = FlagSpec(help=" ".join(help.split()), decls=decls, choices=choices,
                    flag_value=flag_value, is_path=is_path, internal=internal)
    return dataclasses.field(default=default, metadata={FLAG_METADATA: spec})


def flag_spec(field: dataclasses.Field) -> FlagSpec:
    """The field's FlagSpec; a field made without option() is internal."""
    return field.metadata.get(FLAG_METADATA) or FlagSpec(help="", internal=True)


def flag_name(name: str) -> str:
    """A field name as its key and flag spell it: max_seqs -> max-seqs."""
    return name.replace("_", "-")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_number(value: object, key: str, *, low: float | None = None, high: float | None = None,
                 above: float | None = None, integer: bool = False) -> None:
    """`value` is a number (an int if `integer`; never a bool) in range: >= low (or > above)
    and <= high; else ConfigError "KEY must be <what>, got VALUE". key: the flag spelling."""
    kinds = (int,) if integer else (int, float)
    is_number = isinstance(value, kinds) and not isinstance(value, bool)
    in_range = is_number and ((low is None or value >= low)  # type: ignore[operator]
                              and (above is None or value > above)  # type: ignore[operator]
                              and (high is None or value <= high))  # type: ignore[operator]
    if not in_range:
        raise ConfigError(f"{key} must be {_wanted(low, high, above, integer)}, got {value!r}")


def _wanted(low: float | None, high: float | None, above: float | None, integer: bool) -> str:
    """'a positive integer', 'an integer in [0, 128]', 'a number >= 1', 'a number in (0, 1]'."""
    if integer and low == 1 and high is None and above is None:
        return "a positive integer"
    kind = "an integer" if integer else "a number"
    if high is None:
        return f"{kind} >= {_text(low)}" if above is None else f"{kind} > {_text(above)}"
    if low is None and above is None:
        return f"{kind} <= {_text(high)}"
    opening = f"[{_text(low)}" if above is None else f"({_text(above)}"
    return f"{kind} in {opening}, {_text(high)}]"


def _text(bound: float | None) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def check_choice(value: object, key: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{key} must be one of {choices}, got {value!r}")


def check_bool(value: object, key: str) -> None:
    require(isinstance(value, bool), f"{key} must be true or false, got {value!r}")
