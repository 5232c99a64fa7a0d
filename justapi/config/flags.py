"""`justapi serve`'s flags, made from the config sections' fields: one click option per field
(unless the field is internal), its type and choices from the field, its help text from the
field's metadata, and the default shown from the field's own default.

Every option defaults to None, so the command passes on only the flags a person gave (they
override the TOML file). Owns: field -> click option. Does not own: the fields (sections).
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from typing import Any

import click

from justapi.config.fields import flag_name, flag_spec
from justapi.config.serve import SECTION_TYPES

Decorator = Callable[[Any], Any]


def config_options(sections: Iterable[type] = SECTION_TYPES.values()) -> list[Decorator]:
    """A click option per flag field of every section, in the sections' order."""
    options = []
    for section in sections:
        hints = typing.get_type_hints(section)
        for field in dataclasses.fields(section):
            if not flag_spec(field).internal:
                options.append(click.option(*_decls(field), **_settings(field, hints[field.name])))
    return options


def with_config_options(command: Any) -> Any:
    """Decorate a click command with config_options(), listed in order."""
    for option in reversed(config_options()):
        command = option(command)
    return command


def help_text(field: dataclasses.Field) -> str:
    """The field's help, then its default as the field states it (none for "" and None)."""
    spec = flag_spec(field)
    default = default_text(field)
    return f"{spec.help}  [default: {default}]" if default else spec.help


def default_text(field: dataclasses.Field) -> str:
    """How --help shows the field's default: on/off, a number, a string; "" when it has none
    worth showing (an empty string or None: the help says what that means)."""
    value, spec = field.default, flag_spec(field)
    if value is None or value == "":
        return ""
    if spec.flag_value is not None:
        return f"{flag_name(field.name)} {value}"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _decls(field: dataclasses.Field) -> tuple[str, ...]:
    """click declarations, ending with the field name as the parameter name."""
    spec = flag_spec(field)
    if spec.decls:
        return (*spec.decls, field.name)
    name = flag_name(field.name)
    if isinstance(field.default, bool):
        return (f"--{name}/--no-{name}", field.name)
    return (f"--{name}", field.name)


def _settings(field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    spec = flag_spec(field)
    settings: dict[str, Any] = {"default": None, "help": help_text(field)}
    if spec.flag_value is not None:
        settings["flag_value"] = spec.flag_value
    elif spec.choices:
        settings["type"] = click.Choice([choice for choice in spec.choices if choice])
    elif spec.is_path:
        settings["type"] = click.Path(dir_okay=False)
    elif not isinstance(field.default, bool):
        settings["type"] = _value_type(hint)
    elif not any("/" in decl for decl in spec.decls):  # a bool with one declaration: an on-switch
        settings["is_flag"] = True
    return settings


def _value_type(hint: Any) -> type:
    """int, float or str, from the field's annotation (`X | None` gives X)."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    base = args[0] if args else hint
    if base not in (int, float, str):
        raise TypeError(f"no flag type for annotation {hint!r}")
    return base
