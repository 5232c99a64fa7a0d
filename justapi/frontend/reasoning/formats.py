"""Reasoning formats: how a model family marks its thinking, and which one a chat template
speaks (or `--reasoning-parser` forces).

Qwen3 and DeepSeek-R1 (and their distills, QwQ, SmolLM3, GLM...) think inside
`<think>...</think>` before they answer. Whether a reply starts inside its thinking is read from
the rendered prompt, not assumed per family: a template that opens `<think>` in the prompt
(DeepSeek-R1, Qwen3 thinking-2507) leaves it open; a Qwen3 template with thinking switched off
closes it (`<think>\\n\\n</think>`); otherwise the reply may open it itself. Owns: the formats,
the template detection and that reading. Does not own: the split (splitter.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's thinking markers."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def opens_in(self, prompt_text: str) -> bool:
        """The prompt ends inside a thinking block: its last start marker comes after its last
        end marker (so the reply begins with thinking)."""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)


QWEN3 = ReasoningFormat("qwen3")
"""Qwen3 / QwQ: the reply opens `<think>` itself unless the template switched thinking off."""
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1")
"""DeepSeek-R1 and its distills: the template opens `<think>` at the end of the prompt."""
FORMATS = {f.name: f for f in (QWEN3, DEEPSEEK_R1)}
AUTO, NONE = "auto", "none"
PARSER_CHOICES = (AUTO, NONE, *FORMATS)
"""The values of --reasoning-parser."""
_DEEPSEEK_MARKERS = ("<｜Assistant｜>", "<｜assistant｜>")


def detect_reasoning_format(template_source: str) -> ReasoningFormat | None:
    """The family a chat template's model thinks in, from its text (None: it does not think)."""
    if "<think>" not in template_source or "</think>" not in template_source:
        return None
    if any(marker in template_source for marker in _DEEPSEEK_MARKERS):
        return DEEPSEEK_R1
    return QWEN3


def reasoning_format(choice: str, template_source: str) -> ReasoningFormat | None:
    """The format to parse replies with: --reasoning-parser's choice (auto: from the template;
    none: no parsing, thinking stays in the content). ValueError for an unknown name."""
    if choice == AUTO:
        return detect_reasoning_format(template_source)
    if choice == NONE:
        return None
    found = FORMATS.get(choice)
    if found is None:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSER_CHOICES)}, "
                         f"got {choice!r}")
    return found
