"""Chat templates: OpenAI-style message lists -> the model's prompt text, via the GGUF's own
`tokenizer.chat_template` rendered in jinja2's immutable sandbox, as HF's apply_chat_template does
(a file without one gets its architecture's built-in template, builtin_templates.py).

Owns: message validation (tool-call arguments as objects, as templates expect), the sandboxed
environment (HF's variables, filters and whitespace options) and the limits that make a bad
template a ValueError instead of a hang, a memory blow-up or an escape. Does not own: tokenizing
the result (tokenizer.py) or the OpenAI request schema.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from types import FrameType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from justapi.frontend.text.builtin_templates import CHATML_TEMPLATE, builtin_template
from justapi.model.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError", "validate_messages"]
ROLES = ("system", "user", "assistant", "tool")
PASSTHROUGH_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")
RENDER_TIMEOUT_S = 2.0
MIN_RENDER_CHARS = 1_000_000
"""Any string a render builds, and its output, stay under max(this, 4 x the input's size)."""
MAX_RANGE = 100_000
TEMPLATE_FILENAME = "<chat template>"
_HUGE_WIDTH = re.compile(r"\d{7,}")  # a format width of a million or more

_budget: contextvars.ContextVar[_RenderBudget] = contextvars.ContextVar("chat_template_budget")


class ChatTemplateError(ValueError):
    """A template that does not compile, raises, escapes the sandbox or exceeds its limits."""


@dataclass
class _RenderBudget:
    deadline: float
    max_chars: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError("chat template did not finish in time (bad template)")

    def check_size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise ChatTemplateError(f"chat template built a value of {len(value)} items/chars "
                                    f"(limit {self.max_chars})")
        return value


class ChatTemplate:
    """One model's chat template, compiled once; `render` is safe to call from any thread."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 timeout_s: float = RENDER_TIMEOUT_S, name: str = "custom") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template must be a non-empty string")
        self.source = source
        self.name = name
        """'gguf' (the file's own), a built-in's name ('gemma', 'ChatML'...) or 'custom'."""
        self._special_tokens = dict(special_tokens or {})
        self._timeout_s = timeout_s
        try:
            self._template = _SandboxEnvironment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile, special_tokens: dict[str, str]) -> ChatTemplate:
        """The file's `tokenizer.chat_template`, or else its architecture's built-in template;
        logs which. special_tokens: bos_token / eos_token ... as text (Tokenizer.template_tokens)."""
        source = gguf_file.get("tokenizer.chat_template")
        if source:
            logger.info("chat template: %s's own tokenizer.chat_template", gguf_file.path)
            return cls(str(source), special_tokens, name="gguf")
        architecture = gguf_file.architecture
        builtin = builtin_template(architecture,
                                   frozenset(gguf_file.get("tokenizer.ggml.tokens") or ()))
        logger.warning("%s has no tokenizer.chat_template; using the built-in %s template "
                       "(architecture %r)", gguf_file.path, builtin.name, architecture)
        return cls(builtin.source, special_tokens, name=builtin.name)

    def render(self, messages: Any, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for `messages` (validated first; ValueError names the bad field)."""
        checked = validate_messages(messages)
        variables = {**self._special_tokens, **extra, "messages": checked, "tools": tools,
                     "documents": None, "add_generation_prompt": bool(add_generation_prompt)}
        input_chars = len(json.dumps(checked, default=str)) + len(json.dumps(tools, default=str))
        budget = _RenderBudget(time.monotonic() + self._timeout_s,
                               max(MIN_RENDER_CHARS, 4 * input_chars))
        token = _budget.set(budget)
        try:
            with _trace_deadline(budget):
                return _collect(self._template.generate(variables), budget)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # raise_exception(), undefined errors, SecurityError
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        except (RecursionError, MemoryError) as exc:
            raise ChatTemplateError(f"chat template exhausted resources ({type(exc).__name__})") \
                from None
        except Exception as exc:  # a template bug (TypeError on None + str...) is a bad request
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _budget.reset(token)

    __call__ = render


def _collect(chunks: Iterator[str], budget: _RenderBudget) -> str:
    parts, num_chars = [], 0
    for chunk in chunks:
        num_chars += len(chunk)
        if num_chars > budget.max_chars:
            raise ChatTemplateError(f"chat template output exceeds {budget.max_chars} characters")
        parts.append(chunk)
    return "".join(parts)


# -- messages ---------------------------------------------------------------------------------

def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as templates expect them: role in ROLES, content a string (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_validate_message(message, index) for index, message in enumerate(messages)]


def _validate_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    checked = {key: message[key] for key in PASSTHROUGH_KEYS if message.get(key) is not None}
    if not isinstance(checked.get("reasoning_content", ""), str):
        raise ValueError(f"{where}.reasoning_content must be a string")
    if isinstance(checked.get("tool_calls"), list):
        checked["tool_calls"] = [_tool_call_with_object_arguments(call)
                                 for call in checked["tool_calls"]]
    checked["role"] = role
    checked["content"] = _content_text(message.get("content"), role, message, where)
    return checked


def _tool_call_with_object_arguments(call: Any) -> Any:
    """OpenAI sends a call's arguments as a JSON string; templates (Qwen, Llama 3, Mistral)
    write them with `| tojson`, as HF documents: a string that holds a JSON object becomes
    that object (a copy: the request is not changed). Anything else passes as it came."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = call["function"]
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def _content_text(content: Any, role: str, message: dict[str, Any], where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and message.get("tool_calls"):
        return ""
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    texts = []
    for part_index, part in enumerate(content):
        part_where = f"{where}.content[{part_index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{part_where}.type must be 'text', got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{part_where}.text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


# -- the sandbox ------------------------------------------------------------------------------

class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` through the environment so the result's size is checked."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """HF's template environment plus limits: unsafe attribute access raises at once (instead
    of rendering as empty), and operators, calls and filters refuse to build huge values."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols", _GenerationTag])
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        self.filters["tojson"] = _bounded_filter(_tojson)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            range=_bounded_range)

    def _compile(self, source: str, filename: str) -> Any:
        return super()._compile(source, TEMPLATE_FILENAME)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _HUGE_WIDTH.search(value.__self__):
            raise ChatTemplateError("chat template format width is too large")
        return wrapped

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__} object is not allowed in a chat template")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _active_budget().check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _active_budget()
        budget.check_time()
        _check_call(getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None), args, kwargs)
        return budget.check_size(super().call(__context, __obj, *args, **kwargs))

    def bounded_concat(self, values: tuple[Any, ...]) -> str:
        return _active_budget().check_size("".join(map(str, values)))

    def concat(self, values: Any) -> str:  # type: ignore[override]  # {% set %} blocks, output
        return _active_budget().check_size("".join(values))


def _active_budget() -> _RenderBudget:
    budget = _budget.get(None)
    assert budget is not None, "templates render only inside ChatTemplate.render"
    return budget


def _check_binop(operator: str, left: Any, right: Any) -> None:
    max_chars = _active_budget().max_chars
    if operator == "**" and isinstance(right, int) and abs(right) > 64:
        raise ChatTemplateError(f"chat template exponent {right} is too large")
    if operator == "*":
        sized, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and hasattr(sized, "__len__") and len(sized) * count > max_chars:
            raise ChatTemplateError("chat template repeats a value past the size limit")
    if operator == "%" and isinstance(left, str) and _HUGE_WIDTH.search(left):
        raise ChatTemplateError("chat template format width is too large")


# Calls whose result can be far larger than their inputs (str methods and filters).
_AMPLIFIERS = frozenset({"indent", "replace", "center", "ljust", "rjust", "zfill", "expandtabs",
                         "wordwrap", "do_indent", "do_replace", "do_center", "do_wordwrap"})


def _check_call(name: str, value: Any, params: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before it runs, a call of `name` on `value` (a str method's string or a filter's
    input) that would build a value past the size limit: huge counts and widths, huge format
    widths (str.format is checked in wrap_str_format), replace / indent blow-ups, big joins."""
    max_chars = _active_budget().max_chars
    extras = (*params, *kwargs.values())
    for param in extras:
        if isinstance(param, int) and not isinstance(param, bool) and param > max_chars:
            raise ChatTemplateError(f"chat template passed {param} to {name}")
    if name in _AMPLIFIERS and isinstance(value, str):
        factor = max([1, *(len(p) for p in extras if isinstance(p, str)),
                      *(p for p in extras if isinstance(p, int))])
        if (len(value) + 1) * factor > max_chars:
            raise ChatTemplateError(f"chat template {name} would exceed the size limit")
    if name == "do_format" and isinstance(value, str) and _HUGE_WIDTH.search(value):
        raise ChatTemplateError("chat template format width is too large")
    if name in ("join", "do_join"):
        items, separator = (params[0], value) if isinstance(value, str) else (value, params[:1])
        _check_join_size(items, separator, max_chars)


def _check_join_size(items: Any, separator: Any, max_chars: int) -> None:
    if not isinstance(items, (list, tuple, str)):
        return  # generators and mappings: the result's size is checked afterwards
    size = sum(len(item) if isinstance(item, str) else 16 for item in items)
    if isinstance(separator, str):
        size += len(separator) * len(items)
    if size > max_chars:
        raise ChatTemplateError(f"chat template join would build {size} characters")


def _bounded_filter(function: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _active_budget()
        budget.check_time()
        inputs = args[1:] if hasattr(function, "jinja_pass_arg") else args  # skip the context
        if inputs:
            _check_call(getattr(function, "__name__", ""), inputs[0], inputs[1:], kwargs)
        return budget.check_size(function(*args, **kwargs))

    bounded.__name__ = getattr(function, "__name__", "filter")
    if hasattr(function, "jinja_pass_arg"):  # pass_context / pass_environment / pass_eval_context
        bounded.jinja_pass_arg = function.jinja_pass_arg  # type: ignore[attr-defined]
    return bounded


def _bounded_range(*args: int) -> Iterator[int]:
    values = range(*args)
    if len(values) > MAX_RANGE:
        raise ChatTemplateError(f"chat template range of {len(values)} items "
                                f"(at most {MAX_RANGE})")
    return iter(values)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _trace_deadline:  # noqa: N801  (a context manager used like a function)
    """While rendering, a trace hook on the template's own lines enforces the deadline: a loop
    in the template runs Python lines of TEMPLATE_FILENAME, so no loop can outlive it."""

    def __init__(self, budget: _RenderBudget) -> None:
        self._budget = budget
        self._previous: Any = None

    def __enter__(self) -> None:
        self._previous = sys.gettrace()
        sys.settrace(self._global_trace)

    def __exit__(self, *exc_info: object) -> None:
        sys.settrace(self._previous)

    def _global_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == TEMPLATE_FILENAME:
            return self._local_trace
        return self._previous(frame, event, arg) if self._previous is not None else None

    def _local_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._budget.check_time()
        return self._local_trace
