"""Tool calling through the offline engine on the embedded model: forced calls always parse and validate.

Uses the session `served_llm` fixture (SmolLM2-135M-Instruct as served by default: quantized, CPU), whose
template has no tool support, so this also runs the fallback prompt end to end.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.output.types import FinishReason
from engine_server.tokenizer.chat import ChatMessage, ChatTool, ChatToolCall
from engine_server.tools import ToolChoice, ToolChoiceMode, ToolFormat, ToolTemplate

pytestmark = pytest.mark.slow  # the embedded model with tools

WEATHER = ChatTool(
    "get_weather",
    "Current weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
)
SEARCH = ChatTool(
    "search",
    "Search the web",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 48},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["query"],
    },
)
TOOLS = {t.name: t for t in (WEATHER, SEARCH)}


def _check_calls(choice_calls: list[ChatToolCall], allowed: set[str]) -> None:
    assert choice_calls
    for call in choice_calls:
        assert call.name in allowed and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments_json), TOOLS[call.name].parameters)


def test_required_and_named_calls_parse_and_validate(served_llm: LLM) -> None:
    questions = ["What's the weather in Lyon?", "Find papers about tiny language models.", "Is it raining in Lima?"]
    choices = [ToolChoice(ToolChoiceMode.REQUIRED), ToolChoice.function("search"), ToolChoice.function("get_weather")]
    prompts = [
        ChatPrompt([ChatMessage("user", q)], list(TOOLS.values()), tool_choice=c) for q in questions for c in choices
    ]
    params = [SamplingParams(max_tokens=96, temperature=0.8, seed=i) for i in range(len(prompts))]
    for prompt, result in zip(prompts, served_llm.generate(prompts, params, use_tqdm=False), strict=True):
        (choice,) = result.choices
        assert prompt.tool_choice is not None
        named = prompt.tool_choice.mode is ToolChoiceMode.FUNCTION
        _check_calls(choice.tool_calls, {prompt.tool_choice.function_name} if named else set(TOOLS))
        assert choice.text == "" and len(choice.tool_calls) == 1
        assert choice.finish_reason is (FinishReason.STOP if named else FinishReason.TOOL_CALLS)


def test_auto_gives_content_or_valid_calls_and_history_renders(served_llm: LLM) -> None:
    history = [
        ChatMessage("user", "What's the weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(ChatToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", '{"temperature": 18, "sky": "sunny"}', tool_call_id="call_1"),
    ]
    prompts = [
        ChatPrompt([ChatMessage("user", "Weather in Rome, please.")], list(TOOLS.values())),
        ChatPrompt(history, list(TOOLS.values())),
        ChatPrompt(history, list(TOOLS.values()), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)),
    ]
    results = served_llm.chat(prompts, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    for result in results[:2]:
        (choice,) = result.choices
        if choice.tool_calls:
            _check_calls(choice.tool_calls, set(TOOLS))
            assert choice.finish_reason is FinishReason.TOOL_CALLS
        else:  # a plain answer (perhaps with a malformed call left in it, as written)
            assert choice.text and choice.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    _check_calls(results[2].choices[0].tool_calls, set(TOOLS))


@pytest.mark.parametrize("fmt", [ToolFormat.MISTRAL, ToolFormat.MISTRAL_V11])
def test_forced_calls_in_mistrals_formats_parse_with_nine_character_ids(
    served_llm: LLM, fmt: ToolFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine as a Mistral-template model would have it: the grammar writes the format, the parser reads it.
    monkeypatch.setattr(served_llm.inputs, "tool_template", ToolTemplate(format=fmt))
    prompts = [
        ChatPrompt([ChatMessage("user", q)], list(TOOLS.values()), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))
        for q in ("What's the weather in Lyon?", "Find papers about tiny language models.")
    ]
    params = [SamplingParams(max_tokens=96, temperature=0.8, seed=i) for i in range(len(prompts))]
    for result in served_llm.generate(prompts, params, use_tqdm=False):
        (choice,) = result.choices
        assert choice.text == "" and len(choice.tool_calls) == 1, choice.text
        (call,) = choice.tool_calls
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id) and call.name in TOOLS
        jsonschema.validate(json.loads(call.arguments_json), TOOLS[call.name].parameters)
        assert choice.finish_reason is FinishReason.TOOL_CALLS
