"""Chat templates render exactly what HF's apply_chat_template renders; bad templates (escapes,
exceptions, runaway loops, huge values) and bad messages fail as ValueError."""
from __future__ import annotations

import logging
import os
import sys

import pytest

from justapi.frontend.text.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    validate_messages,
)
from justapi.frontend.text.tokenizer import Tokenizer
from justapi.model.gguf_file import GGUFFile, default_model_path

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Und auf Deutsch? 日本語 😀\n  indented\ttab"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  "},
     {"role": "assistant", "content": "<|im_end|> inside"}, {"role": "user", "content": "ok"}],
]

# Templates in the style of popular models, exercising what HF's environment offers:
# trim_blocks/lstrip_blocks, loop controls, namespace, tojson, raise_exception, bos_token.
FEATURE_TEMPLATES = {
    "llama3-like": (
        "{{- bos_token }}\n"
        "{%- for message in messages %}\n"
        "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
        "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
        "{%- endif %}\n"),
    "mistral-like": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) and messages[0]['role'] != "
        "'system' %}{{ raise_exception('Conversation roles must alternate user/assistant') }}"
        "{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
        "{% endfor %}"),
    "indented-blocks": (
        "{% set ns = namespace(turns=0, system='') %}\n"
        "{% for message in messages %}\n"
        "  {% if message.role == 'system' %}\n"
        "    {% set ns.system = message.content %}\n"
        "  {% else %}\n"
        "    {% set ns.turns = ns.turns + 1 %}\n"
        "<{{ message.role }} n={{ ns.turns }}>{{ message.content }}</{{ message.role }}>\n"
        "  {% endif %}\n"
        "  {% if loop.last and ns.system %}\n"
        "[system: {{ ns.system|upper }}]\n"
        "  {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<assistant n={{ ns.turns + 1 }}>{% endif %}"),
    "tools-json": (
        "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"
        "{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}{{ strftime_now('%Y') }}"),
}


@pytest.fixture(scope="module")
def smol_gguf() -> GGUFFile:
    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def smol_template(smol_gguf: GGUFFile) -> ChatTemplate:
    tokenizer = Tokenizer.from_gguf(smol_gguf)
    assert tokenizer.template_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                         "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    return ChatTemplate.from_gguf(smol_gguf, tokenizer.template_tokens)


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_matches_hf(smol_template: ChatTemplate, hf_smol,
                                    add_generation_prompt: bool) -> None:
    for messages in CONVERSATIONS:
        expected = hf_smol.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        assert smol_template.render(messages, add_generation_prompt) == expected
    assert smol_template.render(CONVERSATIONS[0]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_feature_templates_match_hf(name: str, hf_smol) -> None:
    import copy

    source = FEATURE_TEMPLATES[name]
    reference = copy.copy(hf_smol)
    reference.chat_template = source
    ours = ChatTemplate(source, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools)
            assert ours.render(messages, add_generation_prompt, tools=tools) == expected, name


def test_raise_exception_becomes_value_error() -> None:
    template = ChatTemplate(FEATURE_TEMPLATES["mistral-like"], {"bos_token": "<s>",
                                                                "eos_token": "</s>"})
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"
    with pytest.raises(ValueError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "first"}])


def test_text_parts_are_joined() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    assert template.render([{"role": "user", "content": parts}], add_generation_prompt=False) == \
        "<|im_start|>user\nline one\nline two<|im_end|>\n"


def test_tool_call_message_without_content() -> None:
    messages = validate_messages([{"role": "assistant", "content": None,
                                   "tool_calls": [{"id": "1"}], "extra": "dropped"}])
    assert messages == [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hello", "messages"),
    (["hello"], r"messages\[0\]"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}], r"messages\[1\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": 42}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     r"messages\[0\]\.content\[0\]\.type"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
     r"messages\[0\]\.content\[0\]\.text"),
    ([{"role": "user", "content": ["plain"]}], r"messages\[0\]\.content\[0\]\.type"),
])
def test_bad_messages_name_the_field(messages, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ChatTemplate(CHATML_TEMPLATE).render(messages)


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages.__class__ }}",
    "{{ messages[0].__class__.__base__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append(1) %}",
    "{{ messages[0].update({'role': 'x'}) }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_raise(source: str) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


RUNAWAYS = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 5000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ [1] * 10**10 }}",
    "{{ 2 ** 1000000 }}",
    "{{ range(10**10)|list }}",
    "{{ 'x'|center(10**10) }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ ('x' * 100000).replace('', 'y' * 1000) }}",
    "{{ ('a\n' * 100000)|indent(1000) }}",
    "{{ '%9999999999d' % 1 }}",
    "{{ '{:>9999999999}'.format(1) }}",
    "{{ (['y' * 100000] * 100)|join }}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
]


@pytest.mark.parametrize("source", RUNAWAYS)
def test_runaway_templates_fail(source: str) -> None:
    previous = sys.gettrace()
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate(source, timeout_s=0.5).render([{"role": "user", "content": "hi"}])
    assert sys.gettrace() is previous


def test_template_that_does_not_compile() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for message in %}")
    with pytest.raises(ValueError, match="non-empty"):
        ChatTemplate("")


def test_template_type_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_missing_template_falls_back_to_chatml(tmp_path, caplog) -> None:
    spm = pytest.importorskip("sentencepiece")
    from tests.support.gguf_tokenizers import train_sentencepiece, write_spm_gguf

    processor = spm.SentencePieceProcessor(model_proto=train_sentencepiece())
    gguf_file = GGUFFile(str(write_spm_gguf(tmp_path / "plain.gguf", processor)))
    with caplog.at_level(logging.WARNING, logger="justapi.frontend.text.chat_template"):
        template = ChatTemplate.from_gguf(gguf_file, {"bos_token": "<s>", "eos_token": "</s>"})
    assert "ChatML" in caplog.text
    assert template.source == CHATML_TEMPLATE
    assert template([{"role": "user", "content": "hi"}], True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_template_is_used(tmp_path) -> None:
    spm = pytest.importorskip("sentencepiece")
    from tests.support.gguf_tokenizers import train_sentencepiece, write_spm_gguf

    processor = spm.SentencePieceProcessor(model_proto=train_sentencepiece())
    source = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    gguf_file = GGUFFile(str(write_spm_gguf(tmp_path / "t.gguf", processor, chat_template=source)))
    template = ChatTemplate.from_gguf(gguf_file, {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi"


def test_error_type_is_a_value_error() -> None:
    assert issubclass(ChatTemplateError, ValueError)
