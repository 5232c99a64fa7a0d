"""Tool-call formats: how a model family writes its calls, and which one a chat template speaks.

A format names the text that opens the calls (its trigger), the literal pieces around and
between the call objects, and the key that holds the arguments; the parser (parser.py) and
the grammar (grammar.py) both read it, so what is constrained is what is parsed. The format is
chosen from the chat template's text, as llama.cpp does; templates of no known family get the
generic JSON envelope. Owns: the formats and that choice. Does not own: parsing or grammars.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    """One family's call syntax. Literal pieces are matched with any whitespace between them
    when parsing; the grammar writes them exactly as `write_calls` does."""

    name: str
    trigger: str
    """Text that starts the calls; text before it is the message content."""
    keeps_trigger: bool
    """The trigger is the start of the calls' own text (a JSON envelope), not a marker."""
    opener: tuple[str, ...]
    """Pieces after the trigger (or from its start, when kept) before the first call object."""
    after_call: tuple[str, ...]
    """Pieces after every call object (Hermes' closing tag)."""
    between: tuple[str, ...]
    """Pieces between two call objects."""
    closer: tuple[str, ...]
    """Pieces after the last call object."""
    arguments_key: str = "arguments"
    is_parallel: bool = True
    """Whether the format can carry several calls in one reply."""
    id_length: int = 0
    """Tool call ids the template insists on (Mistral: 9 letters or digits); 0: OpenAI's."""
    is_start_only: bool = False
    """Only a reply that starts with the trigger calls (Llama 3: `{"name"` later is text)."""
    args_marker: str = ""
    """Set: a call is `name<args_marker>{arguments}`, not a JSON object (Mistral v11)."""
    id_marker: str = ""
    """Set (with args_marker): the model writes `name<id_marker><id><args_marker>{...}`, its
    own id_length-character call id (Mistral Small 3.2)."""

    @property
    def markers(self) -> tuple[str, ...]:
        """The format's fixed pieces that may be special tokens of a vocabulary."""
        return tuple(m for m in (self.trigger, self.args_marker, self.id_marker) if m)

    def write_calls(self, calls: Sequence[tuple[str, ...]]) -> str:
        """The canonical text of (name, arguments JSON text[, call id]) calls, as the grammar
        forces it."""
        objects = [self.write_call(*call) for call in calls]
        after = "".join(self.after_call)
        inner = (after + "".join(self.between)).join(objects) + after
        prefix = "" if self.keeps_trigger else self.trigger
        return prefix + "".join(self.opener) + inner + "".join(self.closer)

    def write_call(self, name: str, arguments: str, call_id: str = "") -> str:
        if self.args_marker:
            written_id = self.id_marker + call_id if self.id_marker else ""
            return f"{name}{written_id}{self.args_marker}{arguments}"
        return f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}}}'


GENERIC = ToolFormat(
    name="generic", trigger='{"tool_calls"', keeps_trigger=True,
    opener=('{"tool_calls": [',), after_call=(), between=(", ",), closer=("]}",))
"""SmolLM2 and every template of no known family: the reply is text, or a JSON object
{"tool_calls": [{"name": ..., "arguments": {...}}, ...]} (llama.cpp's "Generic" envelope)."""
HERMES = ToolFormat(
    name="hermes", trigger="<tool_call>", keeps_trigger=False, opener=("\n",),
    after_call=("\n</tool_call>",), between=("\n<tool_call>\n",), closer=())
"""Qwen2.5 / Qwen3 / Hermes 2 Pro: <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>."""
LLAMA3 = ToolFormat(
    name="llama3", trigger='{"name"', keeps_trigger=True, opener=(), after_call=(),
    between=("; ",), closer=(), arguments_key="parameters", is_parallel=False,
    is_start_only=True)
"""Llama 3.x: {"name": ..., "parameters": ...}, one call, and only at the start of the reply
(an optional <|python_tag|> before it is a special token the text never shows)."""
MISTRAL = ToolFormat(
    name="mistral", trigger="[TOOL_CALLS]", keeps_trigger=False, opener=("[",), after_call=(),
    between=(", ",), closer=("]",), id_length=9)
"""Mistral: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]."""
MISTRAL_V11 = ToolFormat(
    name="mistral_v11", trigger="[TOOL_CALLS]", keeps_trigger=False, opener=(), after_call=(),
    between=("[TOOL_CALLS]",), closer=(), id_length=9, args_marker="[ARGS]")
"""Mistral's v11 templates (Devstral, Magistral, Ministral 3): [TOOL_CALLS]name[ARGS]{...}
for each call."""
MISTRAL_V11_IDS = ToolFormat(
    name="mistral_v11_ids", trigger="[TOOL_CALLS]", keeps_trigger=False, opener=(),
    after_call=(), between=("[TOOL_CALLS]",), closer=(), id_length=9, args_marker="[ARGS]",
    id_marker="[CALL_ID]")
"""Mistral Small 3.2: [TOOL_CALLS]name[CALL_ID]<9 letters or digits>[ARGS]{...}."""
FORMATS = {f.name: f for f in (GENERIC, HERMES, LLAMA3, MISTRAL, MISTRAL_V11,
                                MISTRAL_V11_IDS)}


def detect_tool_format(template_source: str) -> ToolFormat:
    """The format a chat template speaks, from markers in its text (llama.cpp's way)."""
    if "[TOOL_CALLS]" in template_source:
        if "[ARGS]" not in template_source:
            return MISTRAL
        return MISTRAL_V11_IDS if "[CALL_ID]" in template_source else MISTRAL_V11
    if "<tool_call>" in template_source:
        return HERMES
    if "<|start_header_id|>" in template_source and (
            "ipython" in template_source or "<|python_tag|>" in template_source):
        return LLAMA3
    return GENERIC


def split_pieces(pieces: Sequence[str]) -> tuple[str, ...]:
    """Literal pieces as the parser matches them, with free whitespace between any two:
    '{"tool_calls": [' -> ('{', '"tool_calls"', ':', '[')."""
    return tuple(word for piece in pieces for word in _WORD.findall(piece))


_WORD = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,;]|[^\s{}\[\]:,;"]+')
