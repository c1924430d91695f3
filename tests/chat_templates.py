"""Chat templates of the tool-calling families, written here (nothing fetched) with the structure of each family's
published template: the same control tokens and roles, tools, earlier calls and tool results laid out as that
family's models were trained to read them, and the same refusals where the family's template has them (Mistral's
9-character call ids and alternating roles, Llama 3.1's one call per turn). The instruction prose around the tool
lists is ours; the structure is what the engine's format detection and the models' outputs depend on.

Each entry gives the template and the family's special tokens, bos and eos, and the text the generation prompt
ends with (the cue a scripted model starts its reply from)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTemplate:
    """A family's chat template and tokens; `cue` is the last token of its generation prompt, `tool_cue` the last
    token of a prompt that ends with a tool result (the same as `cue` where a result is followed by a new
    assistant header)."""

    template: str
    special_tokens: tuple[str, ...]
    bos: str
    eos: str
    cue: str
    tool_cue: str
    stops: tuple[str, ...] = ()  # further end-of-sequence tokens (listed in the model's generation_config.json)


# Mistral-7B-Instruct-v0.3 (tokenizer v3): tools before the last user turn, calls as one JSON list after
# [TOOL_CALLS] with 9-character ids, results in [TOOL_RESULTS] with their call id, no assistant header.
MISTRAL_V3 = FamilyTemplate(
    template="""\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools is not defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace(turn=0) %}
{%- for message in loop_messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {%- if (message.role == "user") != (ns.turn % 2 == 0) %}
            {{- raise_exception("roles must alternate user/assistant after the optional system message") }}
        {%- endif %}
        {%- set ns.turn = ns.turn + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {%- if tools is not none and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS] " + tools | tojson + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message.content + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message.content + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls %}
        {{- "[TOOL_CALLS] [" }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not defined or call.id | length != 9 %}
                {{- raise_exception("tool call ids must be 9 letters and digits") }}
            {%- endif %}
            {{- '{"name": ' + call.function.name | tojson + ', "arguments": ' + call.function.arguments | tojson }}
            {{- ', "id": ' + call.id | tojson + "}" }}
            {%- if not loop.last %}{{- ", " }}{%- endif %}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message.role == "assistant" %}
        {{- " " + message.content | trim + eos_token }}
    {%- elif message.role == "tool" %}
        {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
            {{- raise_exception("tool call ids must be 9 letters and digits") }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | tojson }}
        {{- ', "call_id": ' + message.tool_call_id | tojson + "}[/TOOL_RESULTS]" }}
    {%- else %}
        {{- raise_exception("only user, assistant and tool turns after an optional system message") }}
    {%- endif %}
{%- endfor %}
""",
    special_tokens=(
        "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    ),
    bos="<s>",
    eos="</s>",
    cue="[/INST]",
    tool_cue="[/TOOL_RESULTS]",
)

# Mistral Small 3.x (tokenizer v11): a system prompt block, tools before the last user turn, each call as
# [TOOL_CALLS]name[ARGS]{...}, results in [TOOL_RESULTS] without ids.
MISTRAL_V11 = FamilyTemplate(
    template="""\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- if system_message is defined %}{{- "[SYSTEM_PROMPT]" + system_message + "[/SYSTEM_PROMPT]" }}{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {%- if tools and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS]" + tools | tojson + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST]" + message.content + "[/INST]" }}
    {%- elif message.role == "assistant" %}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- "[TOOL_CALLS]" + call.function.name + "[ARGS]" + call.function.arguments | tojson }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == "tool" %}
        {{- "[TOOL_RESULTS]" + message.content + "[/TOOL_RESULTS]" }}
    {%- else %}
        {{- raise_exception("only user, assistant and tool turns after an optional system message") }}
    {%- endif %}
{%- endfor %}
""",
    special_tokens=(
        "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
    ),
    bos="<s>",
    eos="</s>",
    cue="[/INST]",
    tool_cue="[/TOOL_RESULTS]",
)

# Hermes 2 Pro / Qwen2.5: ChatML, tools as JSON lines in <tools> in the system turn, each call in <tool_call>, tool
# results in <tool_response> inside a user turn.
HERMES = FamilyTemplate(
    template="""\
{%- if tools %}
    {{- "<|im_start|>system\\n" }}
    {%- if messages[0].role == "system" %}{{- messages[0].content }}
    {%- else %}{{- "You are a helpful assistant." }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nThe functions you may call are listed in <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" + tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nWrite each call as a JSON object of its name and arguments in <tool_call></tool_call>" }}
    {{- " tags:\\n" }}
    {{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == "system" %}
    {{- "<|im_start|>system\\n" + messages[0].content + "<|im_end|>\\n" }}
{%- else %}
    {{- "<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first)
          or (message.role == "assistant" and not message.tool_calls) %}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
    {%- elif message.role == "assistant" %}
        {{- "<|im_start|>assistant" }}
        {%- if message.content %}{{- "\\n" + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + "}\\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- "<|im_start|>user" }}{%- endif %}
        {{- "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- "<|im_end|>\\n" }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}
""",
    special_tokens=("<|im_start|>", "<|im_end|>"),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    cue="\n",
    tool_cue="\n",
)

# Llama 3.1: the ipython environment in the system turn, tools in the first user turn, a call as one JSON object
# {"name", "parameters"} per assistant turn, results in ipython turns.
LLAMA3_JSON = FamilyTemplate(
    template="""\
{{- bos_token }}
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" + system_message + "<|eot_id|>" }}
{%- if tools %}
    {%- set first_user_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
    {{- "<|start_header_id|>user<|end_header_id|>\\n\\n" }}
    {{- "Answer with a JSON function call when one of these functions helps, in the format " }}
    {{- '{"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
    {%- for tool in tools %}{{- tool | tojson(indent=4) + "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("this model makes one tool call at a time") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>" + message.role + "<|end_header_id|>\\n\\n" + message.content | trim + "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{%- endif %}
""",
    special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    cue="\n",
    tool_cue="\n",
)

# Llama 4: header tokens, tools listed in the system turn, calls written as a Python list of calls (between
# <|python_start|> and <|python_end|> when sent back), results in ipython turns.
PYTHONIC = FamilyTemplate(
    template="""\
{{- bos_token }}
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if tools or system_message %}
    {{- "<|header_start|>system<|header_end|>\\n\\n" + system_message }}
    {%- if tools %}
        {{- "\\n\\nTo call functions, answer with a Python list of calls, [func_name(param=value, ...)], " }}
        {{- "and nothing else. The functions:\\n" + tools | tojson(indent=4) }}
    {%- endif %}
    {{- "<|eot|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls %}
        {{- "<|header_start|>assistant<|header_end|>\\n\\n<|python_start|>[" }}
        {%- for call in message.tool_calls %}
            {{- call.function.name + "(" }}
            {%- for name, value in call.function.arguments.items() %}
                {{- name + "=" + value | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- ")" }}{%- if not loop.last %}{{- ", " }}{%- endif %}
        {%- endfor %}
        {{- "]<|python_end|><|eot|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|header_start|>ipython<|header_end|>\\n\\n" + message.content + "<|eot|>" }}
    {%- else %}
        {{- "<|header_start|>" + message.role + "<|header_end|>\\n\\n" + message.content | trim + "<|eot|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|header_start|>assistant<|header_end|>\\n\\n" }}{%- endif %}
""",
    special_tokens=("<|header_start|>", "<|header_end|>", "<|eom|>", "<|python_start|>", "<|python_end|>"),
    bos="<|begin_of_text|>",
    eos="<|eot|>",
    cue="\n",
    tool_cue="\n",
)

# Qwen3-Coder: ChatML, tools as <function> blocks with <parameter> entries in the system turn, each call as
# <tool_call><function=name><parameter=p>value</parameter>...</function></tool_call>, results in <tool_response>.
QWEN3_CODER = FamilyTemplate(
    template="""\
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\\n" + system_message }}
{%- elif tools %}
    {{- "<|im_start|>system\\nYou are a helpful coding assistant." }}
{%- endif %}
{%- if tools %}
    {{- "\\n\\n# Tools\\n\\nThe functions you may call:\\n\\n<tools>" }}
    {%- for tool in tools %}
        {%- set f = tool.function %}
        {{- "\\n<function>\\n<name>" + f.name + "</name>" }}
        {%- if f.description %}{{- "\\n<description>" + f.description | trim + "</description>" }}{%- endif %}
        {{- "\\n<parameters>" }}
        {%- for name, p in (f.parameters.properties or {}).items() %}
            {{- "\\n<parameter>\\n<name>" + name + "</name>" }}
            {%- if p.type %}{{- "\\n<type>" + p.type | string + "</type>" }}{%- endif %}
            {%- if p.description %}{{- "\\n<description>" + p.description | trim + "</description>" }}{%- endif %}
            {{- "\\n</parameter>" }}
        {%- endfor %}
        {{- "\\n</parameters>\\n</function>" }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nTo call a function, reply with only:\\n\\n<tool_call>\\n<function=the_name>\\n" }}
    {{- "<parameter=a_parameter>\\nits value\\n</parameter>\\n</function>\\n</tool_call>" }}
{%- endif %}
{%- if system_message is defined or tools %}{{- "<|im_end|>\\n" }}{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- "<|im_start|>assistant\\n" + (message.content or "") }}
        {%- for call in message.tool_calls %}
            {{- "\\n<tool_call>\\n<function=" + call.function.name + ">\\n" }}
            {%- for name, value in call.function.arguments.items() %}
                {{- "<parameter=" + name + ">\\n" + (value if value is string else value | tojson) }}
                {{- "\\n</parameter>\\n" }}
            {%- endfor %}
            {{- "</function>\\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or loop_messages[loop.index0 - 1].role != "tool" %}{{- "<|im_start|>user\\n" }}{%- endif %}
        {{- "<tool_response>\\n" + message.content + "\\n</tool_response>\\n" }}
        {%- if loop.last or loop_messages[loop.index0 + 1].role != "tool" %}{{- "<|im_end|>\\n" }}{%- endif %}
    {%- else %}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}
""",
    special_tokens=("<|im_start|>", "<|im_end|>"),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    cue="\n",
    tool_cue="\n",
)

# Qwen3: ChatML; an earlier answer's reasoning is dropped when it is sent back; with `enable_thinking` false the
# generation prompt closes an empty reasoning itself ("<think>\n\n</think>\n\n"), so the model answers at once.
QWEN3 = FamilyTemplate(
    template="""\
{%- for message in messages %}
    {%- if message.role == "assistant" and "</think>" in message.content %}
        {{- "<|im_start|>assistant\\n" + message.content.split("</think>")[-1].lstrip("\\n") + "<|im_end|>\\n" }}
    {%- else %}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- "<think>\\n\\n</think>\\n\\n" }}{%- endif %}
{%- endif %}
""",
    special_tokens=("<|im_start|>", "<|im_end|>"),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    cue="\n",
    tool_cue="\n",
)

# DeepSeek-R1 style: the generation prompt opens the reasoning ("<think>\n"), so the output starts inside it.
DEEPSEEK_R1 = FamilyTemplate(
    template="""\
{%- for message in messages %}
    {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n<think>\\n" }}{%- endif %}
""",
    special_tokens=("<|im_start|>", "<|im_end|>"),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    cue="\n",
    tool_cue="\n",
)

# gpt-oss: OpenAI's harmony format. A system message with the reasoning effort and the channels, a developer message
# with the instructions and the tools as a TypeScript namespace, every message `<|start|>ROLE ... <|message|> ...
# <|end|>`; earlier calls as messages to `functions.NAME` on the commentary channel ending `<|call|>`, their results
# as messages from `functions.NAME` to the assistant; the generation prompt `<|start|>assistant` (the reply writes its
# own channel headers). The end of a reply is `<|return|>` (the eos) or `<|call|>` (also an end of sequence: the
# released generation_config.json lists it).
GPT_OSS = FamilyTemplate(
    template="""\
{%- set effort = reasoning_effort if reasoning_effort is defined else "medium" %}
{{- "<|start|>system<|message|>You are a helpful assistant.\\nReasoning: " + effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- "<|end|>" }}
{%- if messages[0].role in ["system", "developer"] %}
    {%- set instructions = messages[0].content %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set instructions = "" %}
{%- endif %}
{%- if instructions or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if instructions %}{{- "# Instructions\\n\\n" + instructions + "\\n\\n" }}{%- endif %}
    {%- if tools %}
        {{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n" }}
        {%- for tool in tools %}
            {%- set f = tool.function if tool.function is defined else tool %}
            {{- "\\n// " + (f.description or "") + "\\ntype " + f.name + " = (_: " }}
            {{- f.parameters | tojson }}{{- ") => any;\\n" }}
        {%- endfor %}
        {{- "\\n} // namespace functions" }}
    {%- endif %}
    {{- "<|end|>" }}
{%- endif %}
{%- set ns = namespace(last_call="") %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- elif message.role == "assistant" and message.tool_calls %}
        {%- for call in message.tool_calls %}
            {%- set ns.last_call = call.function.name %}
            {%- set arguments = call.function.arguments %}
            {{- "<|start|>assistant to=functions." + call.function.name + "<|channel|>commentary json<|message|>" }}
            {%- if arguments is string %}{{- arguments }}{%- else %}{{- arguments | tojson }}{%- endif %}
            {{- "<|call|>" }}
        {%- endfor %}
    {%- elif message.role == "assistant" %}
        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
    {%- elif message.role == "tool" %}
        {{- "<|start|>functions." + ns.last_call + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content + "<|end|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}
""",
    special_tokens=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"),
    bos="<|startoftext|>",
    eos="<|return|>",
    cue="assistant",
    tool_cue="assistant",
    stops=("<|call|>",),
)

# GLM-4.5 / 4.6: `[gMASK]<sop>`, tools listed in a system turn that teaches `<tool_call>NAME` with `<arg_key>` and
# `<arg_value>` lines, an answer opened by `<|assistant|>` and its reasoning `<think></think>`, calls written one
# argument pair at a time (a string value as is, any other as JSON), results in one `<|observation|>` turn of
# `<tool_response>` blocks. The generation prompt ends with `<|assistant|>`; the model writes its reasoning next.
GLM45 = FamilyTemplate(
    template="""\
[gMASK]<sop>
{%- if tools %}
    {{- "<|system|>\\n# Tools\\n\\nYou may call one or more functions, listed in <tools></tools>:\\n<tools>\\n" }}
    {%- for tool in tools %}{{- tool | tojson + "\\n" }}{%- endfor %}
    {{- "</tools>\\n\\nWrite each function call in this XML format:\\n<tool_call>{function-name}\\n" }}
    {{- "<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{arg-value-1}</arg_value>\\n...\\n</tool_call>" }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == "user" %}{{- "<|user|>\\n" + m.content }}
    {%- elif m.role == "system" %}{{- "<|system|>\\n" + m.content }}
    {%- elif m.role == "assistant" %}
        {{- "<|assistant|>\\n<think></think>" }}
        {%- if m.content %}{{- "\\n" + m.content }}{%- endif %}
        {%- for tc in m.tool_calls or [] %}
            {{- "\\n<tool_call>" + tc.function.name + "\\n" }}
            {%- for k, v in tc.function.arguments.items() %}
                {{- "<arg_key>" + k + "</arg_key>\\n<arg_value>" + (v if v is string else v | tojson) }}
                {{- "</arg_value>\\n" }}
            {%- endfor %}
            {{- "</tool_call>" }}
        {%- endfor %}
    {%- elif m.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- "<|observation|>" }}{%- endif %}
        {{- "\\n<tool_response>\\n" + m.content + "\\n</tool_response>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|assistant|>" }}{%- endif %}
""",
    special_tokens=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<tool_call>",
                    "</tool_call>", "<think>", "</think>"),
    bos="<sop>",
    eos="<|endoftext|>",
    cue="<|assistant|>",
    tool_cue="<|assistant|>",
    stops=("<|user|>", "<|observation|>"),
)

# DeepSeek V3.1: the system prompt first, `<｜User｜>` and `<｜Assistant｜>` turns (`</think>` after the assistant
# marker when not thinking), calls as a `<｜tool▁calls▁begin｜>` section of `NAME<｜tool▁sep｜>ARGUMENTS` calls with the
# arguments joined to the text as the caller's JSON, results as `<｜tool▁output▁begin｜>` blocks; tools are not listed
# (the engine's fallback prompt lists them, in the system turn). The generation prompt ends with `</think>`.
DEEPSEEK_V31 = FamilyTemplate(
    template="""\
{%- set ns = namespace(system="", last_user=false) %}
{%- for m in messages if m.role == "system" %}{%- set ns.system = ns.system + m.content %}{%- endfor %}
{{- bos_token + ns.system }}
{%- for m in messages %}
    {%- if m.role == "user" %}
        {%- set ns.last_user = true %}{{- "<｜User｜>" + m.content }}
    {%- elif m.role == "assistant" %}
        {%- if ns.last_user %}{{- "<｜Assistant｜></think>" }}{%- endif %}
        {%- set ns.last_user = false %}
        {%- if m.tool_calls %}
            {{- (m.content or "") + "<｜tool▁calls▁begin｜>" }}
            {%- for tool in m.tool_calls %}
                {{- "<｜tool▁call▁begin｜>" + tool.function.name + "<｜tool▁sep｜>" + tool.function.arguments }}
                {{- "<｜tool▁call▁end｜>" }}
            {%- endfor %}
            {{- "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>" }}
        {%- else %}{{- m.content + "<｜end▁of▁sentence｜>" }}{%- endif %}
    {%- elif m.role == "tool" %}
        {%- set ns.last_user = false %}
        {{- "<｜tool▁output▁begin｜>" + m.content + "<｜tool▁output▁end｜>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt and ns.last_user %}{{- "<｜Assistant｜></think>" }}{%- endif %}
""",
    special_tokens=("<｜User｜>", "<｜Assistant｜>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"),
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    cue="</think>",
    tool_cue="<｜tool▁output▁end｜>",
)

# Kimi K2: tools declared as JSON in a `tool_declare` system turn, `<|im_user|>` / `<|im_assistant|>` / `<|im_system|>`
# turns closed by `<|im_end|>`, calls as a `<|tool_calls_section_begin|>` section where each call is written by its
# id (`functions.NAME:N`) and its arguments, results as `tool` turns naming the id they answer.
KIMI_K2 = FamilyTemplate(
    template="""\
{%- if tools %}{{- "<|im_system|>tool_declare<|im_middle|>" + tools | tojson + "<|im_end|>" }}{%- endif %}
{%- if messages[0].role != "system" %}
    {{- "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>" }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == "user" %}{{- "<|im_user|>user<|im_middle|>" + m.content }}
    {%- elif m.role == "assistant" %}
        {{- "<|im_assistant|>assistant<|im_middle|>" + (m.content or "") }}
        {%- if m.tool_calls %}
            {{- "<|tool_calls_section_begin|>" }}
            {%- for tool_call in m.tool_calls %}
                {{- "<|tool_call_begin|>" + tool_call.id + "<|tool_call_argument_begin|>" }}
                {{- tool_call.function.arguments | tojson + "<|tool_call_end|>" }}
            {%- endfor %}
            {{- "<|tool_calls_section_end|>" }}
        {%- endif %}
    {%- elif m.role == "tool" %}
        {{- "<|im_system|>tool<|im_middle|>## Return of " + m.tool_call_id + "\\n" + m.content }}
    {%- else %}{{- "<|im_system|>" + m.role + "<|im_middle|>" + m.content }}
    {%- endif %}
    {{- "<|im_end|>" }}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_assistant|>assistant<|im_middle|>" }}{%- endif %}
""",
    special_tokens=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_end|>", "<|tool_call_argument_begin|>"),
    bos="[BOS]",
    eos="<|im_end|>",
    cue="<|im_middle|>",
    tool_cue="<|im_middle|>",
)

# MiniMax-M2: `]~!b[` then `]~b]ROLE` turns closed by `[e~[`, tools as `<tool>` JSON lines in the system turn with an
# example `<minimax:tool_call>` block of `<invoke name=...>` calls, calls written the same way (a string value as is,
# any other as JSON), results as `<response>` blocks of one `]~b]tool` turn; the generation prompt opens the
# reasoning (`]~b]ai\n<think>\n`), so the reply is reasoning up to `</think>`.
MINIMAX_M2 = FamilyTemplate(
    template="""\
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "You are a helpful assistant." %}{%- endif %}
{{- "]~!b[]~b]system\\n" + system_message }}
{%- if tools %}
    {{- "\\n\\n# Tools\\nThe tools you may call, in JSONSchema format:\\n\\n<tools>\\n" }}
    {%- for tool in tools %}{{- "<tool>" + tool.function | tojson + "</tool>\\n" }}{%- endfor %}
    {{- "</tools>\\n\\nCall tools in this XML format:\\n\\n<minimax:tool_call>\\n<invoke name=\\"tool-name-1\\">\\n" }}
    {{- "<parameter name=\\"param-key-1\\">param-value-1</parameter>\\n...\\n</invoke>\\n</minimax:tool_call>" }}
{%- endif %}
{{- "[e~[\\n" }}
{%- for m in messages %}
    {%- if m.role == "assistant" %}
        {{- "]~b]ai\\n" + (m.content or "") }}
        {%- if m.tool_calls %}
            {{- "\\n<minimax:tool_call>\\n" }}
            {%- for tc in m.tool_calls %}
                {{- "<invoke name=\\"" + tc.function.name + "\\">\\n" }}
                {%- for k, v in tc.function.arguments.items() %}
                    {{- "<parameter name=\\"" + k + "\\">" + (v if v is string else v | tojson) + "</parameter>\\n" }}
                {%- endfor %}
                {{- "</invoke>\\n" }}
            {%- endfor %}
            {{- "</minimax:tool_call>" }}
        {%- endif %}
        {{- "[e~[\\n" }}
    {%- elif m.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- "]~b]tool" }}{%- endif %}
        {{- "\\n<response>" + m.content + "</response>" }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- "[e~[\\n" }}{%- endif %}
    {%- else %}{{- "]~b]" + m.role + "\\n" + m.content + "[e~[\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "]~b]ai\\n<think>\\n" }}{%- endif %}
""",
    special_tokens=("]~!b[", "]~b]", "<minimax:tool_call>", "</minimax:tool_call>"),
    bos="]~!b[",
    eos="[e~[",
    cue="<think>\n",
    tool_cue="<think>\n",
)

# Seed-OSS: `<seed:bos>ROLE\n ... <seed:eos>` turns, tools as Python signatures in the system turn with an example
# `<seed:tool_call>` block, calls written as `<function=NAME>` of `<parameter=p>VALUE</parameter>` lines (a value
# that is not a string written with `| string`), results as `tool` turns; a reply thinks first between
# `<seed:think>` and `</seed:think>` (an earlier reply's thinking is written back when the message carries it).
SEED_OSS = FamilyTemplate(
    template="""\
{%- set think_begin_token, think_end_token = "<seed:think>", "</seed:think>" %}
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}
{%- elif tools %}{%- set system_message = "You are Doubao, a helpful AI assistant." %}{%- endif %}
{%- if system_message is defined %}{{- "<seed:bos>system\\n" + system_message }}{%- endif %}
{%- for item in tools or [] %}
    {{- "\\n\\nFunction:\\ndef " + item.function.name + "(" }}
    {{- item.function.parameters.properties | list | join(", ") + "):\\n    \\"\\"\\"" + item.function.description }}
    {{- "\\"\\"\\"" }}
{%- endfor %}
{%- if tools %}
    {{- "\\n\\nCall a function in this format:\\n<seed:tool_call>\\n<function=example_function_name>\\n" }}
    {{- "<parameter=example_parameter_1>value_1</parameter>\\n</function>\\n</seed:tool_call>\\n" }}
{%- endif %}
{%- if system_message is defined %}{{- "<seed:eos>" }}{%- endif %}
{%- for m in messages %}
    {%- if m.role == "assistant" and m.tool_calls %}
        {{- "<seed:bos>assistant" }}
        {%- if m.reasoning_content %}
            {{- "\\n" + think_begin_token + m.reasoning_content + think_end_token }}
        {%- endif %}
        {%- if m.content %}{{- "\\n" + m.content + "\\n" }}{%- endif %}
        {%- for tool_call in m.tool_calls %}
            {{- "\\n<seed:tool_call>\\n<function=" + tool_call.function.name + ">\\n" }}
            {%- for arg_name, arg_value in tool_call.function.arguments | items %}
                {{- "<parameter=" + arg_name + ">" + (arg_value if arg_value is string else arg_value | string) }}
                {{- "</parameter>\\n" }}
            {%- endfor %}
            {{- "</function>\\n</seed:tool_call>" }}
        {%- endfor %}
        {{- "<seed:eos>" }}
    {%- else %}{{- "<seed:bos>" + m.role + "\\n" + m.content + "<seed:eos>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<seed:bos>assistant\\n" }}{%- endif %}
""",
    special_tokens=("<seed:tool_call>", "</seed:tool_call>", "<seed:think>", "</seed:think>"),
    bos="<seed:bos>",
    eos="<seed:eos>",
    cue="\n",
    tool_cue="\n",
)

# Magistral (Mistral's reasoning models): a system prompt that asks for the thinking between `[THINK]` and `[/THINK]`
# (special tokens of its vocabulary, so the engine keeps the special tokens in the text it splits), `[INST]` turns;
# the reply opens `[THINK]` itself.
MAGISTRAL = FamilyTemplate(
    template="""\
{{- bos_token + "[SYSTEM_PROMPT]First draft your thinking process between [THINK] and [/THINK], then answer." }}
{{- "[/SYSTEM_PROMPT]" }}
{%- for m in messages %}
    {%- if m.role == "user" %}{{- "[INST]" + m.content + "[/INST]" }}
    {%- elif m.role == "assistant" %}{{- m.content + eos_token }}
    {%- endif %}
{%- endfor %}
""",
    special_tokens=("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[THINK]", "[/THINK]"),
    bos="<s>",
    eos="</s>",
    cue="[/INST]",
    tool_cue="[/INST]",
)

# NVIDIA Nemotron Nano 2: `<SPECIAL_10>System` and `<SPECIAL_11>ROLE` turns, an assistant turn closed by
# `<SPECIAL_12>`; tools as a JSON list in `<AVAILABLE_TOOLS>`, calls as a JSON list in `<TOOLCALL>`, results as a list
# in a user turn's `<TOOL_RESPONSE>`; the generation prompt opens the reasoning (`<think>\n\n`).
NEMOTRON = FamilyTemplate(
    template="""\
{{- "<SPECIAL_10>System\\n" }}
{%- if messages[0].role == "system" %}{{- messages[0].content }}{%- set messages = messages[1:] %}{%- endif %}
{%- if tools %}
    {{- "You can use these tools if required:\\n<AVAILABLE_TOOLS>[" }}
    {%- for tool in tools %}{{- tool.function | tojson + (", " if not loop.last else "") }}{%- endfor %}
    {{- "]</AVAILABLE_TOOLS>\\n\\nTo call tools, write:\\n" }}
    {{- "<TOOLCALL>[{\\"name\\": \\"tool_name1\\", \\"arguments\\": " }}
    {{- "tool_args1}]</TOOLCALL>\\n\\nTool results come back as <TOOL_RESPONSE>[...]</TOOL_RESPONSE>." }}
{%- endif %}
{{- "\\n\\n" }}
{%- for m in messages %}
    {%- if m.role == "user" %}{{- "<SPECIAL_11>User\\n" + m.content + "\\n" }}
    {%- elif m.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- "<SPECIAL_11>User\\n<TOOL_RESPONSE>[" }}
        {%- endif %}
        {{- m.content }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- "]</TOOL_RESPONSE>\\n\\n" }}
        {%- else %}{{- ", " }}{%- endif %}
    {%- elif m.role == "assistant" %}
        {{- "<SPECIAL_11>Assistant\\n" + (m.content or "") }}
        {%- if m.tool_calls %}
            {{- "<TOOLCALL>[" }}
            {%- for call in m.tool_calls %}
                {{- '{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + "}" }}
                {{- ", " if not loop.last else "" }}
            {%- endfor %}
            {{- "]</TOOLCALL>" }}
        {%- endif %}
        {{- "\\n<SPECIAL_12>\\n\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<SPECIAL_11>Assistant\\n<think>\\n\\n" }}{%- endif %}
""",
    special_tokens=("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOLCALL>", "</TOOLCALL>"),
    bos="<s>",
    eos="<SPECIAL_12>",
    cue="<think>\n\n",
    tool_cue="<think>\n\n",
)

# LFM2: ChatML turns, tools as a JSON list between `<|tool_list_start|>` and `<|tool_list_end|>` in the system turn,
# results wrapped in `<|tool_response_start|>`; its replies write pythonic calls between `<|tool_call_start|>` and
# `<|tool_call_end|>`. The template does not read `tool_calls`: calls sent back are written by the engine, in LFM2's
# layout, into the assistant turn's text (`engine_server.tools.fallback.plain_history`).
LFM2 = FamilyTemplate(
    template="""\
{{- bos_token }}
{%- set ns = namespace(system="") %}
{%- if messages[0].role == "system" %}{%- set ns.system = messages[0].content %}{%- set messages = messages[1:] %}
{%- endif %}
{%- if tools %}
    {%- set ns.system = ns.system + ("\\n" if ns.system else "") + "List of tools: <|tool_list_start|>[" %}
    {%- for tool in tools %}{%- set ns.system = ns.system + tool | tojson + (", " if not loop.last else "") %}
    {%- endfor %}
    {%- set ns.system = ns.system + "]<|tool_list_end|>" %}
{%- endif %}
{%- if ns.system %}{{- "<|im_start|>system\\n" + ns.system + "<|im_end|>\\n" }}{%- endif %}
{%- for m in messages %}
    {%- if m.role == "tool" %}
        {{- "<|im_start|>tool\\n<|tool_response_start|>" + m.content + "<|tool_response_end|><|im_end|>\\n" }}
    {%- else %}{{- "<|im_start|>" + m.role + "\\n" + m.content + "<|im_end|>\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}
""",
    special_tokens=("<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                    "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"),
    bos="<|startoftext|>",
    eos="<|im_end|>",
    cue="\n",
    tool_cue="\n",
)

# Command R7B / Command A (Cohere): `<|START_OF_TURN_TOKEN|>` turns of a role token, a system preamble that (with
# tools) teaches a plan in `<|START_THINKING|>`, actions as a JSON list of `tool_name` / `parameters` objects in
# `<|START_ACTION|>`, and the answer in `<|START_RESPONSE|>` ... `<|END_RESPONSE|>`; tools listed as JSON; results
# in `<|START_TOOL_RESULT|>` system turns. The generation prompt ends with `<|CHATBOT_TOKEN|>`.
COMMAND_R7B = FamilyTemplate(
    template="""\
{{- bos_token + "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\\nYou are Command." }}
{%- if tools %}
    {{- "\\n\\n## Tool Use\\n0. Write <|START_THINKING|>, a step by step plan, then <|END_THINKING|>.\\n" }}
    {{- "1. Action: write <|START_ACTION|>, a list of JSON tool calls with \\"tool_name\\" and \\"parameters\\", " }}
    {{- "then <|END_ACTION|>.\\n2. Response: write <|START_RESPONSE|>, the answer, then <|END_RESPONSE|>.\\n\\n" }}
    {{- "## Available Tools\\n```json\\n[" }}
    {%- for tool in tools %}
        {{- '\\n    {"name": "' + tool.function.name + '", "parameters": ' + tool.function.parameters | tojson + "}" }}
        {{- "," if not loop.last else "" }}
    {%- endfor %}
    {{- "\\n]\\n```" }}
{%- endif %}
{{- "<|END_OF_TURN_TOKEN|>" }}
{%- set ns = namespace(call=0) %}
{%- for m in messages %}
    {%- if m.role == "system" %}{{- "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>" + m.content + "<|END_OF_TURN_TOKEN|>" }}
    {%- elif m.role == "user" %}{{- "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>" + m.content + "<|END_OF_TURN_TOKEN|>" }}
    {%- elif m.role == "assistant" and m.tool_calls %}
        {{- "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>" + (m.reasoning_content or "") }}
        {{- "<|END_THINKING|><|START_ACTION|>[" }}
        {%- for tc in m.tool_calls %}
            {{- '\\n    {"tool_call_id": "' + ns.call | string + '", "tool_name": "' + tc.function.name }}
            {{- '", "parameters": ' + tc.function.arguments | tojson + "}" + ("," if not loop.last else "") }}
            {%- set ns.call = ns.call + 1 %}
        {%- endfor %}
        {{- "\\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>" }}
    {%- elif m.role == "assistant" %}
        {{- "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>" + m.content + "<|END_RESPONSE|>" }}
        {{- "<|END_OF_TURN_TOKEN|>" }}
    {%- elif m.role == "tool" %}
        {{- "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[" }}
        {{- '{"tool_call_id": "' + m.tool_call_id + '", "results": {"0": ' + m.content | tojson + "}}" }}
        {{- "]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>" }}{%- endif %}
""",
    special_tokens=("<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
                    "<|CHATBOT_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>",
                    "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>",
                    "<|END_TOOL_RESULT|>"),
    bos="<BOS_TOKEN>",
    eos="<|END_OF_TURN_TOKEN|>",
    cue="<|CHATBOT_TOKEN|>",
    tool_cue="<|CHATBOT_TOKEN|>",
)

# Gemma 4: `<|turn>ROLE` ... `<turn|>` turns (the assistant's role is `model`), tools as `<|tool>declaration:NAME{...}
# <tool|>` in the system turn, calls as `<|tool_call>call:NAME{key:VALUE}<tool_call|>` in its own literals (strings
# between `<|"|>` quotes, keys bare and sorted); without `enable_thinking` the generation prompt closes an empty
# thought channel (`<|channel>thought\n<channel|>`), so the reply starts with the answer.
GEMMA4 = FamilyTemplate(
    template="""\
{%- macro literal(value) -%}
    {%- if value is string -%}{{- '<|"|>' + value + '<|"|>' -}}
    {%- elif value is mapping -%}
        {{- "{" -}}{%- for k, v in value | dictsort -%}{{- k + ":" + literal(v) + ("," if not loop.last else "") -}}
        {%- endfor -%}{{- "}" -}}
    {%- else -%}{{- value | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- set loop_messages = messages %}
{%- if tools or messages[0].role == "system" %}
    {{- "<|turn>system\\n" }}
    {%- if messages[0].role == "system" %}{{- messages[0].content }}{%- set loop_messages = messages[1:] %}{%- endif %}
    {%- for tool in tools or [] %}
        {{- "<|tool>declaration:" + tool.function.name + '{description:<|"|>' + tool.function.description }}
        {{- '<|"|>,parameters:' + tool.function.parameters | tojson + "}<tool|>" }}
    {%- endfor %}
    {{- "<turn|>\\n" }}
{%- endif %}
{%- for message in loop_messages %}
    {{- "<|turn>" + ("model" if message.role == "assistant" else message.role) + "\\n" }}
    {%- for tool_call in message.tool_calls or [] %}
        {{- "<|tool_call>call:" + tool_call.function.name + literal(tool_call.function.arguments) + "<tool_call|>" }}
    {%- endfor %}
    {{- (message.content or "") + "<turn|>\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|turn>model\\n" }}
    {%- if not enable_thinking | default(false) %}{{- "<|channel>thought\\n<channel|>" }}{%- endif %}
{%- endif %}
""",
    special_tokens=("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|channel>",
                    "<channel|>"),
    bos="<bos>",
    eos="<turn|>",
    cue="<channel|>",
    tool_cue="<channel|>",
)
