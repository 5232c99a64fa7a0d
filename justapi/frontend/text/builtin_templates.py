"""Built-in chat templates for GGUFs that carry no `tokenizer.chat_template` (base models, bare
conversions): chosen by `general.architecture`, and only when the vocabulary holds the family's
turn tokens (a template whose markers are not tokens would be tokenized as plain text).
Owns: the fallback sources and that choice. Does not own: rendering (chat_template.py).
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    source: str
    markers: tuple[str, ...]
    """Tokens the vocabulary must have for this template to apply."""


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Gemma 3's template (google/gemma-3-*-it) for text contents: a system message prefixes the
# first user turn, the assistant's role is 'model', turns must alternate.
GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim }}\n"
    "    {{- '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\n' }}\n"
    "{%- endif -%}\n")

# Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

# Phi-3 / Phi-3.5 mini's template.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

# Mistral's [INST] format (v0.3 vocabulary, where [INST] is a control token); a system message
# prefixes the last user turn, as Mistral's own templates do.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, after an "
    "optional system message') }}{%- endif %}"
    "{%- endfor %}")

CHATML = BuiltinTemplate("ChatML", CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>"))
GEMMA = BuiltinTemplate("gemma", GEMMA_TEMPLATE, ("<start_of_turn>", "<end_of_turn>"))
LLAMA3 = BuiltinTemplate("llama3", LLAMA3_TEMPLATE,
                         ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
PHI3 = BuiltinTemplate("phi3", PHI3_TEMPLATE, ("<|user|>", "<|assistant|>", "<|end|>"))
MISTRAL = BuiltinTemplate("mistral", MISTRAL_TEMPLATE, ("[INST]", "[/INST]"))

# Candidates per architecture, first whose markers are all tokens wins; ChatML after them.
BY_ARCHITECTURE: dict[str, tuple[BuiltinTemplate, ...]] = {
    "gemma": (GEMMA,), "gemma2": (GEMMA,), "gemma3": (GEMMA,),
    "llama": (LLAMA3, MISTRAL),
    "phi3": (PHI3,),
}


def builtin_template(architecture: str, vocabulary: Container[str]) -> BuiltinTemplate:
    """The built-in template for a model of `architecture` whose tokens are `vocabulary`:
    its family's when the vocabulary has the family's turn tokens, else ChatML."""
    for candidate in BY_ARCHITECTURE.get(architecture, ()):
        if all(marker in vocabulary for marker in candidate.markers):
            return candidate
    return CHATML
