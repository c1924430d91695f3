"""The Responses API's conversions: input items to the engine's chat request (and the 400s naming `input[i]`,
`tools[i]`...), engine replies to output items and statuses, and the streamed events, which the OpenAI SDK's own
stream accumulator must take and finish with the items of the whole reply."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from gateway.errors import APIError
from gateway.responses.events import ResponseEvents
from gateway.schemas.responses import ResponsesRequest
from gateway.translate import responses_from_engine, responses_to_engine
from ladle.v1 import engine_pb2, types_pb2

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def body(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def request_for(**fields: Any) -> engine_pb2.GenerateRequest:
    parsed = body(**fields)
    return responses_to_engine.generate_request(parsed, responses_to_engine.input_items(parsed), "rid")


def refusal(**fields: Any) -> APIError:
    with pytest.raises(APIError) as raised:
        request_for(**fields)
    assert raised.value.status == 400
    return raised.value


def test_a_string_is_one_user_message_and_every_item_gets_an_id() -> None:
    items = responses_to_engine.input_items(body(input="hi"))
    assert len(items) == 1 and items[0]["id"].startswith("msg_") and items[0]["role"] == "user"
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    given = responses_to_engine.input_items(body(input=[{"role": "assistant", "content": "a", "id": "msg_x"},
                                                         {"type": "function_call", "call_id": "c", "name": "f",
                                                          "arguments": "{}"}]))
    assert given[0]["id"] == "msg_x" and given[0]["content"] == [{"type": "output_text", "text": "a"}]
    assert given[1]["id"].startswith("fc_")


def test_items_become_the_chat_conversation() -> None:
    request = request_for(instructions="Be brief.", tools=[TOOL], input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                     {"type": "input_text", "text": "Now"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
        {"role": "developer", "content": "Answer now."},
    ])
    messages = request.input.chat.messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "system"]
    assert messages[0].content == "Be brief." and messages[1].content == "Weather?\nNow"
    assert messages[2].content == "Checking." and [c.id for c in messages[2].tool_calls] == ["call_1", "call_2"]
    assert messages[3].tool_call_id == "call_1" and messages[3].name == "get_weather" and messages[3].content == "Rain"
    assert request.input.chat.tools[0].strict  # the Responses API's default


def test_the_request_fields_map_to_the_engine_request() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = request_for(input="x", max_output_tokens=7, temperature=0.5, top_logprobs=3, tools=[TOOL],
                          tool_choice={"type": "function", "name": "get_weather"},
                          text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
                          reasoning={"effort": "none"})
    assert request.sampling.max_tokens == 7 and request.sampling.temperature == 0.5
    assert request.sampling.logprobs and request.sampling.top_logprobs == 3
    assert request.input.chat.tool_choice.function_name == "get_weather"
    assert request.constraint.json_schema and '"integer"' in request.constraint.json_schema
    assert '"enable_thinking": false' in request.input.chat.chat_template_kwargs_json
    assert request_for(input="x", text={"format": {"type": "json_object"}}).constraint.HasField("json_object")


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "include": ["file_search_call.results", "everything"]}, "include"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": []}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refusal(**fields).param == param


def choice(**fields: Any) -> types_pb2.Choice:
    return types_pb2.Choice(index=0, **fields)


def test_a_reply_becomes_output_items_and_a_status() -> None:
    shell = responses_from_engine.response_shell(body(input="x"), "resp_1", "m", "in_progress")
    usage = types_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=2, reasoning_tokens=1)
    reply = engine_pb2.GenerateResponse(usage=usage, choices=[choice(
        text="Hi", reasoning_content="think", finish_reason=types_pb2.FINISH_REASON_TOOL_CALLS,
        tool_calls=[types_pb2.ToolCall(id="call_1", name="f", arguments_json="{}")])])
    response = responses_from_engine.from_reply(shell, reply, want_logprobs=False)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["status"] == "completed" and response["output"][2]["call_id"] == "call_1"
    assert response["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                                 "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 8}
    cut = responses_from_engine.from_reply(shell, engine_pb2.GenerateResponse(choices=[choice(
        text="Hi", finish_reason=types_pb2.FINISH_REASON_LENGTH)]), want_logprobs=False)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    aborted = responses_from_engine.from_reply(shell, engine_pb2.GenerateResponse(choices=[choice(
        finish_reason=types_pb2.FINISH_REASON_ABORT)]), want_logprobs=False)
    assert aborted["status"] == "failed" and aborted["error"]["code"] == "server_error"
    empty = responses_from_engine.from_reply(shell, engine_pb2.GenerateResponse(choices=[choice(
        finish_reason=types_pb2.FINISH_REASON_STOP)]), want_logprobs=False)
    assert [i["type"] for i in empty["output"]] == ["message"] and empty["output"][0]["content"][0]["text"] == ""


def deltas() -> list[types_pb2.ChoiceDelta]:
    lp = types_pb2.TokenLogprob(token="Hi", logprob=-0.5, token_bytes=b"Hi")
    return [
        types_pb2.ChoiceDelta(reasoning_content="Let me "),
        types_pb2.ChoiceDelta(reasoning_content="think."),
        types_pb2.ChoiceDelta(text="Hi", logprobs=[lp]),
        types_pb2.ChoiceDelta(text=" there."),
        types_pb2.ChoiceDelta(tool_calls=[types_pb2.ToolCallDelta(index=0, id="call_a", name="f",
                                                                  arguments_json_delta='{"x": ')]),
        types_pb2.ChoiceDelta(tool_calls=[types_pb2.ToolCallDelta(index=0, arguments_json_delta="1}"),
                                          types_pb2.ToolCallDelta(index=1, id="call_b", name="g",
                                                                  arguments_json_delta="{}")]),
        types_pb2.ChoiceDelta(finish_reason=types_pb2.FINISH_REASON_TOOL_CALLS),
    ]


def test_streamed_events_are_what_the_sdk_accumulates_into_the_whole_reply() -> None:
    shell = responses_from_engine.response_shell(body(input="x"), "resp_1", "m", "in_progress")
    builder = ResponseEvents(shell, want_logprobs=True)
    events = builder.start()
    for delta in deltas():
        events += builder.delta(delta)
    closing, response = builder.finish(types_pb2.FINISH_REASON_TOOL_CALLS, types_pb2.Usage(prompt_tokens=1))
    events += [*closing, builder.last(response)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"

    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    final = state._completed_response
    assert final is not None and final.output_text == "Hi there."
    whole = responses_from_engine.output_items(types_pb2.Choice(
        text="Hi there.", reasoning_content="Let me think.", finish_reason=types_pb2.FINISH_REASON_TOOL_CALLS,
        logprobs=[types_pb2.TokenLogprob(token="Hi", logprob=-0.5, token_bytes=b"Hi")],
        tool_calls=[types_pb2.ToolCall(id="call_a", name="f", arguments_json='{"x": 1}'),
                    types_pb2.ToolCall(id="call_b", name="g", arguments_json="{}")]), want_logprobs=True)

    def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    assert without_ids(response["output"]) == without_ids(whole)
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3]
    assert [e["item"]["id"] for e in added] == [i["id"] for i in response["output"]]


@pytest.mark.parametrize("fields", [{"temperature": False}, {"temperature": "0.5"}, {"max_output_tokens": 8.0},
                                    {"store": "yes"}, {"text": {"format": {"type": "json_schema", "strict": 1}}},
                                    {"reasoning": {"effort": 1}}])
def test_bodies_are_type_checked_as_openai_checks_them(fields: dict[str, Any]) -> None:
    """No value is converted to its field's type (a boolean or a string is no number, 8.0 no integer), nested
    objects too; a JSON integer is still a number."""
    with pytest.raises(pydantic.ValidationError):
        body(**fields)
    assert body(temperature=1, top_p=1).temperature == 1.0
