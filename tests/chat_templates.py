"""Chat templates in the style of real instruct checkpoints (written for the tests, same constructs)."""

# Qwen2.5-Instruct style (ChatML): default system prompt, tools rendered with tojson
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.function.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3.1-Instruct style: bos_token written by the template, header ids, strftime_now date
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma-IT (verbatim construct): raises on a system role and on non-alternating roles
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

# Exercises the rest of transformers' environment: namespace(), loop controls, dict(), tojson
# options and non-ASCII, the {% generation %} tag, trim_blocks / lstrip_blocks, extra variables
MISC = """{% set ns = namespace(n=0, last='') %}
{% for m in messages %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% set ns.last = m.role %}
<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}</{{ m.role }}>
{% endfor %}
{{ dict(count=ns.n, last=ns.last, note="é ✓ <b>") | tojson }}
{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>",
                  "<start_of_turn>", "<end_of_turn>"]

# style -> tokenizer_config fields (besides the chat template) and whether the tokenizer's
# post-processor prepends a BOS (as Llama 3's and Gemma's tokenizer.json do)
STYLES = {
    "chatml": dict(config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                   template=CHATML, post_bos=None),
    "llama3": dict(config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                   template=LLAMA3, post_bos="<|begin_of_text|>"),
    "gemma": dict(config={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<|endoftext|>"},
                  template=GEMMA, post_bos="<bos>"),
    "named": dict(config={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
                  template=[{"name": "default", "template": CHATML},
                            {"name": "tool_use", "template": CHATML.replace("You are Qwen", "You are a tool user")},
                            {"name": "misc", "template": MISC}],
                  post_bos=None),
}
