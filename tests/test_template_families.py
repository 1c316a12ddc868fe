"""Templates written the way the model families llaisys runs write theirs (Llama 3.1 with tools,
Qwen 2.5 with tools, Qwen 3 with thinking, Gemma 3, Mistral's tool block) render byte for byte
as transformers renders them, through every guard of the bounded sandbox (slices, ``|trim``,
``|tojson(indent=4)``, ``messages[::-1]``, ``split``, namespaces, ``raise_exception``). The
reference is transformers' own ``render_jinja_template``."""
from __future__ import annotations

import pytest

from llaisys.models.chat_template import ChatTemplate, render_chat

LLAMA31_TOOLS = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("There is no user message to hold the tools") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Reply with a JSON function call {\\"name\\": ..., \\"parameters\\": {...}} to one of:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("One tool call per message") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nThe functions you may call, one per line:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nCall one as <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_THINKING = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in message.content %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
            {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Mistral's templates test `tools is not none`: transformers passes tools=None when there are none
MISTRAL_TOOLS = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools is not none and loop.last %}
            {{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' + message['content'] + '[/INST]' }}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now. «Ünïcode» stays as it is.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
CHAT = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hello!\n"},
        {"role": "assistant", "content": "Hi. How can I help?"}, {"role": "user", "content": "Weather in Paris?"}]
TOOL_CHAT = CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "content": "18 C, sunny"}, {"role": "tool", "content": "wind 5 km/h"}]
THINKING = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

CASES = {
    "llama31-tools": (LLAMA31_TOOLS, CHAT[:2], [WEATHER], {"date_string": "26 Jul 2024"}),
    "llama31-tool-call": (LLAMA31_TOOLS, TOOL_CHAT[:-1], [WEATHER], {"date_string": "26 Jul 2024"}),
    "llama31-no-tools": (LLAMA31_TOOLS, CHAT, None, {"date_string": "26 Jul 2024",
                                                     "tools_in_user_message": False}),
    "qwen25-tools": (QWEN25_TOOLS, TOOL_CHAT, [WEATHER], {}),
    "qwen25-plain": (QWEN25_TOOLS, CHAT[1:], None, {}),
    "qwen3-thinking": (QWEN3_THINKING, THINKING, None, {}),
    "qwen3-no-thinking": (QWEN3_THINKING, THINKING[:3], None, {"enable_thinking": False}),
    "gemma3": (GEMMA3, CHAT, None, {}),
    "gemma3-no-system": (GEMMA3, CHAT[1:], None, {}),
    "mistral-no-tools": (MISTRAL_TOOLS, CHAT[1:], None, {}),
    "mistral-tools": (MISTRAL_TOOLS, CHAT[1:], [WEATHER], {}),
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_templates_render_as_transformers_does(case: str, add_generation_prompt: bool):
    from transformers.utils.chat_template_utils import render_jinja_template

    template, messages, tools, extra = CASES[case]
    want, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                    add_generation_prompt=add_generation_prompt, **SPECIAL, **extra)
    variables = {**SPECIAL, **extra, **({"tools": tools} if tools is not None else {})}
    got = render_chat(ChatTemplate(template, case), messages, add_generation_prompt, **variables)
    assert got == want[0]


def test_a_family_template_refusing_a_conversation_names_its_origin():
    with pytest.raises(ValueError, match="chat template from gemma3 failed: Conversation roles must alternate"):
        render_chat(ChatTemplate(GEMMA3, "gemma3"), [{"role": "user", "content": "a"}] * 2, **SPECIAL)
