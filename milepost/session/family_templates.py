"""TITO-safe chat templates that a family carries when its checkpoints' published template cannot
extend a session turn by turn (report 2.4.3: the registration gives the session server a rendering
it can trust). Each is written from the published definition, keeps its text layout, and fixes only
what breaks multi-turn rendering; the server logs that it renders with the family's template.

DeepSeek-V3 (published in the V3-0324 checkpoint): a lone tool call is rendered without the
`<｜tool▁calls▁end｜><｜end▁of▁sentence｜>` the model writes after it, the first-call and
first-output flags are never reset (a second tool-calling turn loses its section header, a second
round of outputs its `<｜tool▁outputs▁begin｜>`), and a tool-calling turn needs `content` null.
Here every assistant turn closes its calls and itself, each round of outputs opens and closes its
own section, and content and calls may come together.
"""

from __future__ import annotations

DEEPSEEK_V3_TITO = (
    "{% set ns = namespace(is_tool=false, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    # After tool outputs the section's end is the assistant's header (as published).
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{%- set ns.is_tool = false -%}"
    "{%- else %}{{ '<｜Assistant｜>' }}{%- endif %}"
    "{{- message['content'] or '' }}"
    "{%- if message['tool_calls'] %}{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for tool in message['tool_calls'] %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
    " + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```'"
    " + '<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if ns.is_tool %}{{ '\\n' }}{%- else %}{{ '<｜tool▁outputs▁begin｜>' }}{%- endif %}"
    "{%- set ns.is_tool = true -%}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}{%- endfor -%}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{ '<｜Assistant｜>' }}{% endif %}"
)
