"""Tools into the prompt: template detection, the fallback tools prompt, history turns, and tool_choice checks."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from engine_server.errors import ValidationError
from engine_server.frontend import ChatPrompt, InputProcessor
from engine_server.tokenizer.chat import ChatMessage, ChatTool, ChatToolCall
from engine_server.tools import ToolChoice, ToolChoiceMode, ToolFormat, ToolTemplate
from engine_server.tools.fallback import plain_history, tools_system_prompt, with_tools_system_prompt
from engine_server.tools.parsing import parse_tool_calls

WEATHER = ChatTool(
    "get_weather",
    "Current weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
SEARCH = ChatTool("search", "Search the web", {"type": "object", "properties": {"query": {"type": "string"}}})
HISTORY = [
    ChatMessage("user", "Weather in Paris and Oslo?"),
    ChatMessage(
        "assistant",
        "Checking.",
        tool_calls=(
            ChatToolCall("call_1", "get_weather", '{"city": "Paris"}'),
            ChatToolCall("call_2", "get_weather", '{"city": "Oslo"}'),
        ),
    ),
    ChatMessage("tool", "18C and sunny", tool_call_id="call_1"),
    ChatMessage("tool", "-3C and snow", tool_call_id="call_2"),
]
# A minimal template with native tool support, in the Hermes style.
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer: Any) -> InputProcessor:
    return InputProcessor(smollm2_tokenizer, 49152, 2048, eos_token_ids=[2])


@pytest.fixture(scope="module")
def native_inputs(smollm2_tokenizer: Any) -> InputProcessor:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = NATIVE_TEMPLATE
    return InputProcessor(tokenizer, 49152, 2048, eos_token_ids=[2])


def test_smollm2_has_no_tool_support_so_the_fallback_is_used(inputs: InputProcessor) -> None:
    assert inputs.tool_template == ToolTemplate(ToolFormat.HERMES, native_tools=False, native_history=False)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (None, ToolTemplate()),
        (NATIVE_TEMPLATE, ToolTemplate(ToolFormat.HERMES, True, True)),
        (
            "{% if tools %}{% for m in messages %}{% if m.role == 'ipython' %}{{ m.tool_calls }}{% endif %}"
            "<|python_tag|>{% endfor %}{% endif %}",
            ToolTemplate(ToolFormat.LLAMA3_JSON, True, True),
        ),
        ({"default": "{{ messages }}", "tool_use": NATIVE_TEMPLATE}, ToolTemplate(ToolFormat.HERMES, True, True)),
    ],
)
def test_template_detection(template: Any, expected: ToolTemplate) -> None:
    assert ToolTemplate.detect(template) == expected


def test_the_fallback_prompt_lists_every_tool_as_json_and_teaches_the_call_format() -> None:
    prompt = tools_system_prompt([WEATHER, SEARCH])
    lines = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in lines] == ["get_weather", "search"]
    assert json.loads(lines[0])["function"]["parameters"] == WEATHER.parameters
    example = prompt[prompt.index("<tool_call>\n{") :].split("</tool_call>")[0] + "</tool_call>"
    assert parse_tool_calls(example, ToolFormat.HERMES).calls  # the taught format is what the parser reads


def test_the_fallback_prompt_joins_an_existing_system_message_or_becomes_one() -> None:
    with_system = with_tools_system_prompt([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")], [SEARCH])
    assert with_system[0].content.startswith("Be brief.\n\n# Tools") and len(with_system) == 2
    without = with_tools_system_prompt([ChatMessage("user", "hi")], [SEARCH])
    assert [m.role for m in without] == ["system", "user"] and without[0].content.startswith("# Tools")


def test_plain_history_writes_calls_as_tool_call_text_and_results_as_one_user_turn() -> None:
    plain = plain_history(HISTORY)
    assert [m.role for m in plain] == ["user", "assistant", "user"]
    assistant = plain[1]
    assert assistant.tool_calls == () and assistant.content.startswith("Checking.\n<tool_call>\n")
    calls = parse_tool_calls(assistant.content, ToolFormat.HERMES).calls
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert (
        plain[2].content
        == "<tool_response>\n18C and sunny\n</tool_response>\n<tool_response>\n-3C and snow\n</tool_response>"
    )


def test_smollm2_renders_tools_and_tool_history_through_the_fallback(inputs: InputProcessor) -> None:
    text = inputs.render(ChatPrompt(HISTORY, [WEATHER, SEARCH]))
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "search"' in text and "You are a helpful AI assistant" not in text
    assert (
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    )
    assert "<|im_start|>user\n<tool_response>\n18C and sunny\n</tool_response>" in text
    assert "<|im_start|>tool" not in text and text.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_leaves_the_tools_out_but_keeps_the_history(inputs: InputProcessor) -> None:
    text = inputs.render(ChatPrompt(HISTORY, [WEATHER], tool_choice=ToolChoice(ToolChoiceMode.NONE)))
    assert "# Tools" not in text and "<tool_response>\n18C and sunny" in text
    assert inputs.render(ChatPrompt([ChatMessage("user", "hi")])) == inputs.render(
        ChatPrompt([ChatMessage("user", "hi")], [WEATHER], tool_choice=ToolChoice(ToolChoiceMode.NONE))
    )


def test_a_template_with_tool_support_renders_tools_and_history_itself(native_inputs: InputProcessor) -> None:
    text = native_inputs.render(ChatPrompt(HISTORY, [WEATHER]))
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    assert "# Tools" not in text and "tool: 18C and sunny" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text


@pytest.mark.parametrize(
    ("tools", "choice"),
    [
        ([WEATHER], ToolChoice.function("search")),
        ([], ToolChoice.function("get_weather")),
        ([], ToolChoice(ToolChoiceMode.REQUIRED)),
    ],
)
def test_a_tool_choice_that_cannot_be_honoured_is_refused(
    inputs: InputProcessor, tools: list[ChatTool], choice: ToolChoice
) -> None:
    with pytest.raises(ValidationError) as error:
        inputs.render(ChatPrompt([ChatMessage("user", "hi")], tools, tool_choice=choice))
    assert error.value.param == "tool_choice"
