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

Mistral (Instruct v0.3 with v3 control tokens, and tekken checkpoints such as Nemo, which differ
only in the spaces after control tokens): the system prompt joins the last user message and the
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


def _tekken(v3: str) -> str:
    """Mistral's tekken layout (Nemo and later) from the v3 one: the published templates differ
    only in the space after each control token (and v3 trims an answer and prefixes a space)."""
    for a, b in (("[AVAILABLE_TOOLS] [", "[AVAILABLE_TOOLS]["), ("'[INST] '", "'[INST]'"),
                 ("[TOOL_CALLS] [", "[TOOL_CALLS]["), ("[TOOL_RESULTS] {", "[TOOL_RESULTS]{"),
                 ("' ' + message['content']|trim + eos_token", "message['content'] + eos_token")):
        assert a in v3, a
        v3 = v3.replace(a, b)
    return v3


MISTRAL_TEKKEN_TITO = _tekken(MISTRAL_TITO)

# gpt-oss (harmony). The published template (milepost/testing/family_chat_templates.py) renders a
# final answer in history with <|end|> where the model wrote <|return|>, and drops every analysis
# message but the one before a pending tool call: a session keeps what the model wrote, so its
# rendering of turn n + 1 cannot begin with turn n's. Here each assistant turn renders as the model
# writes it (analysis, then the final answer closed by <|return|> or one call closed by <|call|>),
# the reasoning is read from reasoning_content (or thinking), and the system, developer and tool
# messages, the tool list (TypeScript namespace) and the layout are the published ones. Built-in
# tools (browser, python) are left out.
GPT_OSS_TOOLS = r'''{%- macro render_typescript_type(param_spec, required_params, is_nullable=false) -%}
    {%- if param_spec.type == "array" -%}
        {%- if param_spec['items'] -%}
            {%- if param_spec['items']['type'] == "string" -%}
                {{- "string[]" }}
            {%- elif param_spec['items']['type'] == "number" or param_spec['items']['type'] == "integer" -%}
                {{- "number[]" }}
            {%- elif param_spec['items']['type'] == "boolean" -%}
                {{- "boolean[]" }}
            {%- else -%}
                {%- set inner_type = render_typescript_type(param_spec['items'], required_params) -%}
                {%- if inner_type == "object | object" or inner_type|length > 50 -%}
                    {{- "any[]" }}
                {%- else -%}
                    {{- inner_type + "[]" }}
                {%- endif -%}
            {%- endif -%}
            {%- if param_spec.nullable -%}
                {{- " | null" }}
            {%- endif -%}
        {%- else -%}
            {{- "any[]" }}
            {%- if param_spec.nullable -%}
                {{- " | null" }}
            {%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type is defined and param_spec.type is iterable and param_spec.type is not string and param_spec.type is not mapping and param_spec.type[0] is defined -%}
        {%- if param_spec.type | length > 1 -%}
            {{- param_spec.type | join(" | ") }}
        {%- else -%}
            {{- param_spec.type[0] }}
        {%- endif -%}
    {%- elif param_spec.type == "string" -%}
        {%- if param_spec.enum -%}
            {{- '"' + param_spec.enum|join('" | "') + '"' -}}
        {%- else -%}
            {{- "string" }}
            {%- if param_spec.nullable %}
                {{- " | null" }}
            {%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type == "number" or param_spec.type == "integer" -%}
        {{- "number" }}
    {%- elif param_spec.type == "boolean" -%}
        {{- "boolean" }}
    {%- elif param_spec.type == "object" -%}
        {%- if param_spec.properties -%}
            {{- "{\n" }}
            {%- for prop_name, prop_spec in param_spec.properties.items() -%}
                {{- prop_name -}}
                {%- if prop_name not in (param_spec.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{ render_typescript_type(prop_spec, param_spec.required or []) }}
                {%- if not loop.last -%}
                    {{-", " }}
                {%- endif -%}
            {%- endfor -%}
            {{- "}" }}
        {%- else -%}
            {{- "object" }}
        {%- endif -%}
    {%- else -%}
        {{- "any" }}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_tool_namespace(namespace_name, tools) -%}
    {{- "## " + namespace_name + "\n\n" }}
    {{- "namespace " + namespace_name + " {\n\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + tool.description + "\n" }}
        {{- "type "+ tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\n" }}
            {%- for param_name, param_spec in tool.parameters.properties.items() %}
                {%- if param_spec.description %}
                    {{- "// " + param_spec.description + "\n" }}
                {%- endif %}
                {{- param_name }}
                {%- if param_name not in (tool.parameters.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{- render_typescript_type(param_spec, tool.parameters.required or []) }}
                {%- if param_spec.default is defined -%}
                    {{- ", // default: " + param_spec.default|tojson }}
                {%- endif -%}
                {{- ",\n" }}
            {%- endfor %}
            {{- "}) => any;\n\n" }}
        {%- else -%}
            {{- "() => any;\n\n" }}
        {%- endif -%}
    {%- endfor %}
    {{- "} // namespace " + namespace_name }}
{%- endmacro -%}
'''

# The system and developer messages of the published template.
GPT_OSS_HEAD = r'''{{- "<|start|>system<|message|>" }}
{%- if model_identity is not defined %}
    {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
{%- endif %}
{{- model_identity + "\n" }}
{{- "Knowledge cutoff: 2024-06\n" }}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\n\n" }}
{%- if reasoning_effort is not defined %}
    {%- set reasoning_effort = "medium" %}
{%- endif %}
{{- "Reasoning: " + reasoning_effort + "\n\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools -%}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif -%}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\n\n" }}
        {{- developer_message }}
        {{- "\n\n" }}
    {%- endif %}
    {%- if tools -%}
        {{- "# Tools\n\n" }}
        {{- render_tool_namespace("functions", tools) }}
    {%- endif -%}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
'''

GPT_OSS_TITO = GPT_OSS_TOOLS + GPT_OSS_HEAD + r'''{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- set thinking = message.reasoning_content or message.thinking or "" %}
        {%- if thinking %}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + thinking + "<|end|>" }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- if message.content %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- endif %}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + tool_call.name + "<|channel|>commentary json<|message|>" }}
            {{- tool_call.arguments|tojson + "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}'''
