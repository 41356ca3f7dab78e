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

Mistral (Instruct v0.3, v3 control tokens): the system prompt joins the last user message and the
tool list sits right before it, so each new user turn moves both and the rendering of turn n + 1
does not begin with turn n's. Here both go with the first user message, where they stay; the
9-character id check is left out (the ids are the model's own, or the parser's). The rest of the
layout is the published one.
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

MISTRAL_TITO = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- set ns = namespace(first_user=true) %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if ns.first_user and tools %}{{- '[AVAILABLE_TOOLS] [' }}"
    "{%- for tool in tools %}{%- set tool = tool.function %}"
    "{{- '{\"type\": \"function\", \"function\": {' }}"
    "{%- for key, val in tool.items() if key != 'return' %}"
    "{%- if val is string %}{{- '\"' + key + '\": \"' + val + '\"' }}"
    "{%- else %}{{- '\"' + key + '\": ' + val|tojson }}{%- endif %}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '}}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' }}{%- endif %}{%- endfor %}"
    "{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if ns.first_user and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- set ns.first_user = false %}"
    "{%- elif message.tool_calls is defined and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}"
    "{{- out[:-1] + ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message['content']|string + ', ' }}"
    "{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported, with "
    "an initial optional system message') }}{%- endif %}"
    "{%- endfor %}"
)
