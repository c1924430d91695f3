"""Tool calling through the OpenAI SDK: tool_choice required and named always yield parseable, schema-valid calls
(20 trials each, streamed and whole), auto answers with content or valid calls, and tool results render."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string",
                                                                          "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 40}, "max_results": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 10}},
    "required": ["query", "max_results"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
QUESTIONS = [
    "What's the weather in Paris?", "Find recipes for pancakes.", "Is it raining in Tokyo?",
    "Look up the tallest building.", "How warm is it in Cairo in fahrenheit?", "Search for news about Mars.",
    "Weather in Berlin please.", "Who won the 2018 World Cup?", "Temperature in Lima?", "Find a good sci-fi book.",
]
MAX_TOKENS = 300  # the longest valid call: two bounded strings of up to 4 byte-tokens per character


def _validate(calls: list[tuple[str, str, str]], allowed: set[str]) -> None:
    assert calls, "no tool call"
    for call_id, name, arguments in calls:
        assert call_id and name in allowed, (call_id, name)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _ask(client: openai.OpenAI, model: str, trial: int, choice: Any, stream: bool) -> tuple[list[Any], str | None]:
    """(calls as (id, name, arguments), finish reason) of one request."""
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": QUESTIONS[trial % len(QUESTIONS)]}],
        "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX_TOKENS, "temperature": 0.2 + 0.04 * trial,
        "seed": trial,
    }
    if not stream:
        reply = client.chat.completions.create(**body)
        message = reply.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
        return calls, reply.choices[0].finish_reason
    parts: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                entry = parts.setdefault(delta.index, ["", "", ""])
                if delta.id:
                    assert not entry[0], "the id is sent once, with the first delta of a call"
                    entry[0] = delta.id
                if delta.function and delta.function.name:
                    entry[1] = delta.function.name
                if delta.function and delta.function.arguments:
                    entry[2] += delta.function.arguments
    return [tuple(parts[i]) for i in sorted(parts)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_tool_calls_always_parse_and_validate(
    openai_client: openai.OpenAI, model_id: str, mode: str, stream: bool
) -> None:
    def trial(i: int) -> tuple[list[Any], str | None, set[str], str]:
        name = ["get_weather", "search"][i % 2]
        choice: Any = "required" if mode == "required" else {"type": "function", "function": {"name": name}}
        calls, finish = _ask(openai_client, model_id, i, choice, stream)
        allowed = set(SCHEMAS) if mode == "required" else {name}
        return calls, finish, allowed, "tool_calls" if mode == "required" else "stop"

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(trial, range(20)))
    for calls, finish, allowed, expected_finish in results:
        _validate(calls, allowed)
        assert finish == expected_finish  # OpenAI: "stop" when a named function was forced


def test_auto_gives_content_or_valid_calls(openai_client: openai.OpenAI, model_id: str) -> None:
    for trial in range(4):
        calls, finish = _ask(openai_client, model_id, trial, "auto", stream=False)
        if calls:
            _validate(calls, set(SCHEMAS))
            assert finish == "tool_calls"
        else:
            assert finish in {"stop", "length"}


def test_a_tool_result_turn_renders_and_answers(openai_client: openai.OpenAI, model_id: str) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = openai_client.chat.completions.create(
        model=model_id, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=32, temperature=0,
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
