"""The values the ``chat_template`` config keys and data_prep's ``--chat-template`` take: a built-in
template by name or a Jinja file (engine/data/chat_templates.py applies them to tokenizers)."""

from __future__ import annotations

import os

# ChatML (Qwen's layout). With tools= it renders their schemas in a system turn, then the row's own
# system message, as Qwen2.5's template does, so that ``<tool_call>{...}</tool_call>``
# (engine/environments/tools.py) is the format the prompt asks for; without tools it is plain ChatML.
CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN = {"chatml": CHATML}


class TemplateError(ValueError):
    """A chat template that cannot be used; the message names the option that gave it."""


def resolve(value: str, option: str) -> str:
    """The template text of ``value`` (the ``option`` that gave it): a built-in name or a Jinja file."""
    if value in BUILT_IN:
        return BUILT_IN[value]
    if not os.path.isfile(value):
        raise TemplateError(f"{option} {value!r}: neither a built-in ({', '.join(BUILT_IN)}) nor a Jinja file")
    with open(value, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise TemplateError(f"{option} {value!r}: the file is empty")
    return text
