"""gpt-oss's harmony output read apart end to end: `ladle engine` on a scripted model (a real checkpoint whose reply
is known, tests/scripted.py) carrying a harmony chat template (tests/chat_templates.py GPT_OSS), behind the
gateway. The official OpenAI SDK sees the analysis channel as `reasoning_content`, the final channel alone as the
content, a message to `functions.NAME` as a tool call (`finish_reason` tool_calls: the reply ended at `<|call|>`,
an end of sequence only the model's generation_config.json names), streamed and not, through chat and the
Responses API, with the reasoning's tokens counted; `reasoning_effort` reaches the template. How the split works at
every split point of a stream is tested in tests/unit/test_harmony.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.chat_templates import GPT_OSS
from tests.e2e.gateway_process import serve_scripted

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
ANSWER = '{"answer": 4}'
THOUGHT = "Two and two make four."
CALL_THOUGHT = "The user wants the weather."
ARGUMENTS = '{"city": "Rome"}'
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
SCRIPTS = {
    # Reasoning, then the answer on the final channel; 9 tokens, the first 5 the reasoning message.
    "answer": {"assistant": ("<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>", "<|start|>",
                             "assistant<|channel|>final<|message|>", ANSWER, "<|return|>")},
    # Reasoning, then a call to get_weather, ending at <|call|>.
    "call": {"assistant": ("<|channel|>", "analysis", "<|message|>", CALL_THOUGHT, "<|end|>", "<|start|>",
                           "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                           ARGUMENTS, "<|call|>")},
}  # fmt: skip


@dataclass
class Served:
    model: str
    client: openai.OpenAI


@pytest.fixture(scope="module")
def answering(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_scripted(tmp_path_factory.mktemp("answer"), GPT_OSS, SCRIPTS["answer"]) as (model, _, _, client):
        yield Served(model, client)


@pytest.fixture(scope="module")
def calling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_scripted(tmp_path_factory.mktemp("call"), GPT_OSS, SCRIPTS["call"]) as (model, _, _, client):
        yield Served(model, client)


def test_the_answer_apart_from_the_reasoning(answering: Served) -> None:
    reply = answering.client.chat.completions.create(model=answering.model, messages=QUESTION, max_tokens=32)  # type: ignore[arg-type]
    choice = reply.choices[0]
    message = choice.message.to_dict()
    assert (choice.finish_reason, message["content"]) == ("stop", ANSWER)
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    assert reply.usage is not None and reply.usage.completion_tokens == 9
    assert reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5
    reasoning, content = "", ""
    stream = answering.client.chat.completions.create(model=answering.model, messages=QUESTION, max_tokens=32,
                                                      stream=True)  # type: ignore[arg-type]  # fmt: skip
    for chunk in stream:
        for streamed in chunk.choices:
            reasoning += (streamed.delta.model_extra or {}).get("reasoning_content") or ""
            content += streamed.delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)


def test_reasoning_effort_reaches_the_template(answering: Served) -> None:
    """The system message says `Reasoning: <effort>`: "high" is one byte (one token of this tokenizer) longer than
    "low"."""
    counts = {}
    for effort in ("low", "high"):
        reply = answering.client.chat.completions.create(
            model=answering.model, messages=QUESTION, max_tokens=32, reasoning_effort=effort,  # type: ignore[arg-type]
        )
        assert reply.usage is not None and reply.choices[0].message.content == ANSWER
        counts[effort] = reply.usage.prompt_tokens
    assert counts["high"] == counts["low"] + 1


def test_a_call_is_a_tool_call_streamed_or_not(calling: Served) -> None:
    reply = calling.client.chat.completions.create(model=calling.model, messages=QUESTION, tools=TOOLS,
                                                   max_tokens=32)  # type: ignore[arg-type]  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert (choice.message.model_extra or {})["reasoning_content"] == CALL_THOUGHT
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert call.id.startswith("call_")
    names, arguments, finish = "", "", None
    stream = calling.client.chat.completions.create(model=calling.model, messages=QUESTION, tools=TOOLS,
                                                    max_tokens=32, stream=True)  # type: ignore[arg-type]  # fmt: skip
    for chunk in stream:
        for streamed in chunk.choices:
            finish = streamed.finish_reason or finish
            for piece in streamed.delta.tool_calls or []:
                names += piece.function.name or "" if piece.function else ""
                arguments += piece.function.arguments or "" if piece.function else ""
    assert (names, arguments, finish) == ("get_weather", ARGUMENTS, "tool_calls")
    # The call and its result sent back render as harmony's messages to and from functions.get_weather.
    history = [*QUESTION, choice.message.to_dict(), {"role": "tool", "tool_call_id": call.id, "content": "Sunny."}]
    again = calling.client.chat.completions.create(model=calling.model, messages=history, tools=TOOLS, max_tokens=32)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason == "tool_calls"


def test_without_tools_the_call_is_not_read(calling: Served) -> None:
    reply = calling.client.chat.completions.create(model=calling.model, messages=QUESTION, max_tokens=32)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and not choice.message.content


def test_a_forced_call_is_a_grammar_of_harmony_calls_after_free_reasoning(calling: Served) -> None:
    """tool_choice required and a named function: a grammar that lets the analysis message through and then
    writes harmony's call header and the tool's arguments (the scripted reply fits it token for token, so the
    reply is the script's); beside a response_format, a 400."""
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = calling.client.chat.completions.create(model=calling.model, messages=QUESTION, tools=TOOLS,  # type: ignore[arg-type]
                                                       tool_choice=tool_choice, max_tokens=32)  # type: ignore[arg-type]  # fmt: skip
        choice = reply.choices[0]
        (call,) = choice.message.tool_calls or []
        assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS), tool_choice
        assert (choice.message.model_extra or {})["reasoning_content"] == CALL_THOUGHT
    with pytest.raises(openai.BadRequestError) as refused:
        calling.client.chat.completions.create(model=calling.model, messages=QUESTION, tools=TOOLS,  # type: ignore[arg-type]
                                               tool_choice="required", response_format={"type": "json_object"},
                                               max_tokens=32)  # fmt: skip
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_a_json_schema_constrains_the_final_channel_after_the_reasoning(answering: Served) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema, "strict": True}}
    reply = answering.client.chat.completions.create(model=answering.model, messages=QUESTION, max_tokens=32,  # type: ignore[arg-type]
                                                     response_format=response_format)  # fmt: skip
    message = reply.choices[0].message
    assert json.loads(message.content or "") == {"answer": 4}
    assert (message.model_extra or {})["reasoning_content"] == THOUGHT


def test_the_responses_api_sees_a_reasoning_item_and_a_function_call(calling: Served) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}
    response = calling.client.responses.create(model=calling.model, input="Weather in Rome?", tools=[tool],  # type: ignore[list-item]
                                               max_output_tokens=32)  # fmt: skip
    kinds = [item.type for item in response.output]
    assert "reasoning" in kinds and kinds[-1] == "function_call", kinds
    call = response.output[-1]
    assert call.type == "function_call" and (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
