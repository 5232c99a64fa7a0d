"""Real models' chat templates (Gemma 3, Qwen 2.5 and 3, Llama 3.2, Mistral Nemo, Phi-3.5)
render exactly what HF's renderer makes of them, tool calls included; a GGUF without a template
gets its architecture's built-in one, and says so."""
from __future__ import annotations

import copy
import logging

import pytest

from justapi.frontend.text.builtin_templates import (
    CHATML,
    GEMMA,
    LLAMA3,
    MISTRAL,
    PHI3,
    builtin_template,
)
from justapi.frontend.text.chat_template import ChatTemplate, validate_messages
from justapi.model.gguf_file import GGUFFile
from tests.support.chat_templates import (
    CONVERSATIONS,
    GEMMA3,
    PHI35,
    QWEN25,
    REAL_TEMPLATES,
    TOOL_CALL,
    WEATHER_TOOL,
    as_hf_messages,
)
from tests.support.gguf_tokenizers import OverriddenGGUF, train_sentencepiece, write_spm_gguf


def _hf_render(source: str, messages: list, add_generation_prompt: bool, tools, variables: dict):
    """HF's rendering, or the exception it raises."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[as_hf_messages(messages)], tools=tools, chat_template=source,
            add_generation_prompt=add_generation_prompt, **variables)
    except Exception as exc:  # noqa: BLE001  (compared with ours below)
        return exc
    return rendered[0]


@pytest.mark.parametrize("family", sorted(REAL_TEMPLATES))
def test_real_templates_match_hf(family: str) -> None:
    real = REAL_TEMPLATES[family]
    ours = ChatTemplate(real.source, real.special_tokens)
    tool_options = [None, [WEATHER_TOOL]] if real.supports_tools else [None]
    num_rendered = 0
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            for tools in tool_options:
                expected = _hf_render(real.source, messages, add_generation_prompt, tools,
                                      {**real.special_tokens, **real.extra})
                where = f"{family} / {name} / agp={add_generation_prompt} / tools={bool(tools)}"
                if isinstance(expected, Exception):
                    with pytest.raises(ValueError):
                        ours.render(messages, add_generation_prompt, tools=tools, **real.extra)
                    continue
                rendered = ours.render(messages, add_generation_prompt, tools=tools, **real.extra)
                assert rendered == expected, where
                num_rendered += 1
    assert num_rendered >= 6  # the comparison is not vacuous


def test_gemma3_renders_the_gemma_turn_format() -> None:
    template = ChatTemplate(GEMMA3, REAL_TEMPLATES["gemma3"].special_tokens)
    assert template.render(CONVERSATIONS["system"]) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert template.render(CONVERSATIONS["multi-turn"], add_generation_prompt=False).count(
        "<start_of_turn>model\n4<end_of_turn>\n") == 1
    with pytest.raises(ValueError, match="alternate"):
        template.render(CONVERSATIONS["roles-out-of-order"])


def test_qwen_tool_call_arguments_are_objects() -> None:
    template = ChatTemplate(QWEN25, REAL_TEMPLATES["qwen2.5"].special_tokens)
    text = template.render(CONVERSATIONS["tool-call"], tools=[WEATHER_TOOL])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Zürich", "unit": "celsius"}}\n</tool_call><|im_end|>\n') in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n' in text
    assert '"description": "City name, e.g. Zürich"' in text  # tojson keeps non-ASCII


def test_tool_call_arguments_parsed_without_touching_the_request() -> None:
    broken = {**TOOL_CALL, "function": {"name": "f", "arguments": "{not json"}}
    listed = {**TOOL_CALL, "function": {"name": "f", "arguments": "[1, 2]"}}
    request = [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL, broken, listed]}]
    before = copy.deepcopy(request)
    (checked,) = validate_messages(request)
    assert request == before
    arguments = [call["function"]["arguments"] for call in checked["tool_calls"]]
    assert arguments == [{"city": "Zürich", "unit": "celsius"}, "{not json", "[1, 2]"]
    assert checked["tool_calls"][0]["id"] == "call12345"


# -- built-in templates for GGUFs without one ------------------------------------------------

GEMMA_VOCAB = frozenset({"<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"})


@pytest.mark.parametrize("architecture, vocabulary, expected", [
    ("gemma3", GEMMA_VOCAB, GEMMA),
    ("gemma2", GEMMA_VOCAB, GEMMA),
    ("gemma3", frozenset({"<bos>"}), CHATML),  # no turn tokens: ChatML, as before
    ("llama", frozenset({"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}), LLAMA3),
    ("llama", frozenset({"<s>", "[INST]", "[/INST]"}), MISTRAL),
    ("llama", frozenset({"<|im_start|>", "<|im_end|>"}), CHATML),
    ("phi3", frozenset({"<|user|>", "<|assistant|>", "<|end|>"}), PHI3),
    ("qwen2", frozenset({"<|im_start|>", "<|im_end|>"}), CHATML),
    ("qwen3moe", frozenset(), CHATML),
])
def test_builtin_template_by_architecture(architecture, vocabulary, expected) -> None:
    assert builtin_template(architecture, vocabulary) is expected


@pytest.mark.parametrize("builtin, real, tokens", [
    (GEMMA, GEMMA3, REAL_TEMPLATES["gemma3"].special_tokens),
    (PHI3, PHI35, REAL_TEMPLATES["phi3.5"].special_tokens),
])
def test_builtin_templates_render_like_the_family(builtin, real, tokens) -> None:
    ours, theirs = ChatTemplate(builtin.source, tokens), ChatTemplate(real, tokens)
    for name in ("user", "system", "multi-turn", "thinking"):
        for add_generation_prompt in (True, False):
            assert ours.render(CONVERSATIONS[name], add_generation_prompt) == \
                theirs.render(CONVERSATIONS[name], add_generation_prompt), name


def test_builtin_llama3_and_mistral_formats() -> None:
    llama3 = ChatTemplate(LLAMA3.source, {"bos_token": "<|begin_of_text|>"})
    assert llama3.render(CONVERSATIONS["system"]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    mistral = ChatTemplate(MISTRAL.source, {"bos_token": "<s>", "eos_token": "</s>"})
    assert mistral.render([CONVERSATIONS["system"][0], *CONVERSATIONS["multi-turn"]]) == (
        "<s>[INST] 2+2?[/INST] 4</s>[INST] You are terse.\n\n"
        "Und auf Deutsch? 日本語 😀\n  indented\ttab[/INST]")


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> GGUFFile:
    spm = pytest.importorskip("sentencepiece")
    processor = spm.SentencePieceProcessor(model_proto=train_sentencepiece())
    return GGUFFile(str(write_spm_gguf(tmp_path_factory.mktemp("tpl") / "t.gguf", processor)))


def test_gguf_without_template_uses_its_architecture_builtin(spm_gguf, caplog) -> None:
    tokens = [*spm_gguf.get("tokenizer.ggml.tokens"), "<start_of_turn>", "<end_of_turn>"]
    gemma_like = OverriddenGGUF(spm_gguf, {"general.architecture": "gemma3",
                                           "tokenizer.ggml.tokens": tokens})
    with caplog.at_level(logging.INFO, logger="justapi.frontend.text.chat_template"):
        template = ChatTemplate.from_gguf(gemma_like, {"bos_token": "<bos>"})
    assert template.name == "gemma" and template.source == GEMMA.source
    assert "built-in gemma template" in caplog.text and "gemma3" in caplog.text
    assert template.render(CONVERSATIONS["user"]) == \
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"


def test_gguf_template_use_is_logged(spm_gguf, caplog) -> None:
    with_template = OverriddenGGUF(spm_gguf, {"tokenizer.chat_template": PHI35})
    with caplog.at_level(logging.INFO, logger="justapi.frontend.text.chat_template"):
        template = ChatTemplate.from_gguf(with_template, {"eos_token": "</s>"})
    assert template.name == "gguf" and template.source == PHI35
    assert "own tokenizer.chat_template" in caplog.text


def test_inspect_names_the_builtin_template(spm_gguf) -> None:
    from justapi.ops.inspect_gguf import describe, render

    tokens = list(spm_gguf.get("tokenizer.ggml.tokens"))
    tokens[3:6] = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    report = describe(OverriddenGGUF(spm_gguf, {"tokenizer.ggml.tokens": tokens}), None, 1)
    assert report["builtin_chat_template"] == "llama3"
    assert "none (the server uses its built-in llama3 template)" in render(report, False, False)
    with_template = OverriddenGGUF(spm_gguf, {"tokenizer.chat_template": PHI35})
    assert describe(with_template, None, 1)["builtin_chat_template"] == ""
