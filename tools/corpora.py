"""The shared real-world corpora (`../shared/corpora` beside the checkout): public JSON
Schemas with one prompt each (schemas/, SchemaStore) and function-calling cases with their
accepted answers (bfcl/, BFCL), for tests and benchmarks. Data only, never copied here.

Found at $JUSTAPI_CORPORA, else `<repo>/../shared/corpora`, else `/work/shared/corpora`.
Owns: finding and reading them, and BFCL's scoring rule. Does not own: what is measured.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CANDIDATES = (REPO.parent / "shared" / "corpora", Path("/work/shared/corpora"))
BFCL_FILES = ("simple", "multiple", "parallel", "parallel_multiple")
_IGNORED_CHARS = re.compile(r"[ ,./\-_*^]")


def corpora_dir() -> Path | None:
    """The corpora's folder, or None when this machine has none."""
    override = os.environ.get("JUSTAPI_CORPORA")
    for candidate in ([Path(override)] if override else []) + list(CANDIDATES):
        if (candidate / "schemas" / "MANIFEST.json").is_file():
            return candidate
    return None


@dataclass(frozen=True)
class SchemaCase:
    file: str
    schema: dict[str, Any]
    prompt: str
    keywords: tuple[str, ...]


def schema_cases(root: Path) -> list[SchemaCase]:
    """Every schema of the manifest, with its prompt."""
    manifest = json.loads((root / "schemas" / "MANIFEST.json").read_text())
    prompts = {p["file"]: p["prompt"] for p in json.loads(
        (root / "schemas" / "prompts.json").read_text())}
    return [SchemaCase(entry["file"], json.loads((root / "schemas" / entry["file"]).read_text()),
                       prompts[entry["file"]], tuple(entry["keywords"])) for entry in manifest]


@dataclass(frozen=True)
class ToolCase:
    id: str
    category: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    """OpenAI tool definitions (`function` with name, description, parameters)."""
    names: dict[str, str]
    """Our tool name -> BFCL's original name (dots became underscores)."""
    answer: list[dict[str, Any]]


def tool_cases(root: Path) -> list[ToolCase]:
    cases = []
    for category in BFCL_FILES:
        for line in (root / "bfcl" / f"{category}.jsonl").read_text().splitlines():
            case = json.loads(line)
            tools = [{"type": "function", "function": t["function"]}
                     for t in case["openai_tools"]]
            names = {t["function"]["name"]: t["name_original"] for t in case["openai_tools"]}
            cases.append(ToolCase(case["id"], category, case["question"][0], tools, names,
                                  case["answer"]))
    return cases


def is_correct(case: ToolCase, calls: list[tuple[str, dict[str, Any]]]) -> bool:
    """BFCL's rule: the calls pair one-to-one (any order) with the answer's entries; a call
    matches an entry named as its tool's original name when every argument is among that
    parameter's allowed values (`""` allowed: it may be left out; no unlisted argument)."""
    entries = list(case.answer)
    if len(calls) != len(entries):
        return False
    for name, arguments in calls:
        original = case.names.get(name, name)
        match = next((e for e in entries if original in e
                      and _arguments_match(arguments, e[original])), None)
        if match is None:
            return False
        entries.remove(match)
    return True


def _arguments_match(arguments: dict[str, Any], allowed: dict[str, list[Any]]) -> bool:
    if not isinstance(arguments, dict) or set(arguments) - set(allowed):
        return False
    for name, values in allowed.items():
        if name not in arguments:
            if "" not in values:
                return False
        elif not any(_same(arguments[name], value) for value in values):
            return False
    return True


def _same(given: Any, accepted: Any) -> bool:
    """BFCL's comparison: an int for a float, strings lowercased without spaces and
    `,./-_*^`, lists and dicts element-wise."""
    if isinstance(given, bool) or isinstance(accepted, bool):
        return given is accepted
    if isinstance(accepted, float) and isinstance(given, int):
        return float(given) == accepted
    if isinstance(accepted, str) and isinstance(given, str):
        return _IGNORED_CHARS.sub("", given.lower()) == _IGNORED_CHARS.sub("", accepted.lower())
    if isinstance(accepted, list) and isinstance(given, list):
        return len(given) == len(accepted) and all(map(_same, given, accepted))
    if isinstance(accepted, dict) and isinstance(given, dict):
        return set(given) <= set(accepted) and all(
            any(_same(given[k], v) for v in (accepted[k] if isinstance(accepted[k], list)
                                              else [accepted[k]])) for k in given)
    return bool(given == accepted)
