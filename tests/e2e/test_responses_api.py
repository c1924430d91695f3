"""The Responses API through the official OpenAI SDK against the real engine (the embedded model): create with a
string, items and instructions (greedy output equal to the chat route's for the same conversation), json_schema
output that validates, a function tool round trip through previous_response_id, streamed semantic events in order
and equal to the whole response for the same seed, retrieve / delete / input_items, background runs polled and
cancelled, truncation, input token counts equal to what a response reads, a batch job of /v1/responses lines, and
the errors in OpenAI's shape."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 60, "maxItems": 60}
LONG = dict(NUMBERS, minItems=2000, maxItems=2000)  # ~4,000 tokens: a minute or more of decoding here
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
}


def wait_until(client: openai.OpenAI, response_id: str, statuses: set[str], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        assert response.status in ("queued", "in_progress"), f"{response_id} ended {response.status}"
        time.sleep(0.2)
    return response


def test_string_items_and_instructions_answer_as_the_chat_route(openai_client: openai.OpenAI, model_id: str) -> None:
    """The same conversation, greedy, gives the same text through /v1/responses as through /v1/chat/completions."""
    chat = openai_client.chat.completions.create(
        model=model_id, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": "What is the capital of France?"}])
    expected = chat.choices[0].message.content
    by_instructions = openai_client.responses.create(
        model=model_id, temperature=0, max_output_tokens=24, instructions="Answer in one sentence.",
        input="What is the capital of France?")
    by_items = openai_client.responses.create(
        model=model_id, temperature=0, max_output_tokens=24,
        input=[{"role": "developer", "content": "Answer in one sentence."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    for response in (by_instructions, by_items):
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.output_text == expected, (response.output_text, expected)
        assert response.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
        assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        message = response.output[-1]
        assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert by_instructions.instructions == "Answer in one sentence."


def test_json_schema_output_validates(openai_client: openai.OpenAI, model_id: str) -> None:
    """Sampled (seeded) under a schema whose every value is bounded, so the object always closes well inside the
    token limit: the response is complete and its text validates."""
    response = openai_client.responses.create(
        model=model_id, input="Name a large city and its population.", max_output_tokens=200, temperature=0.7,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        extra_body={"seed": 4})
    assert response.status == "completed", response.incomplete_details
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text is not None and response.text.format.type == "json_schema"


def test_a_function_tool_round_trip(openai_client: openai.OpenAI, model_id: str) -> None:
    """A required tool call, then its output sent back with previous_response_id: the model answers."""
    first = openai_client.responses.create(
        model=model_id, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
        max_output_tokens=100, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("fc_"), first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["parameters"])
    second = openai_client.responses.create(
        model=model_id, previous_response_id=first.id, tools=[WEATHER_TOOL], max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}])
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn and its call are in the prompt
    items = openai_client.responses.input_items.list(second.id)
    assert [(i.type, i.call_id) for i in items.data] == [("function_call_output", calls[0].call_id)]


def test_streamed_events_arrive_in_order_and_equal_the_whole_response(
    openai_client: openai.OpenAI, model_id: str
) -> None:
    body: dict[str, Any] = {"model": model_id, "input": "Tell me about the sea.", "max_output_tokens": 40,
                            "temperature": 0.9, "extra_body": {"seed": 11}}
    whole = openai_client.responses.create(**body)
    events = list(openai_client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds.index("response.output_text.delta") == 4
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage is not None and whole.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)
    item_ids = {e.item_id for e in deltas} | {events[2].item.id, final.output[0].id}
    assert len(item_ids) == 1  # one message item, the same id in every event and in the final response


def test_the_sdk_stream_helper_gives_the_final_response(openai_client: openai.OpenAI, model_id: str) -> None:
    with openai_client.responses.stream(model=model_id, input="Reply with a JSON list of 60 digits.",
                                        max_output_tokens=400, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "digits",
                                                         "schema": NUMBERS}}) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(texts) == final.output_text
    jsonschema.validate(json.loads(final.output_text), NUMBERS)
    assert openai_client.responses.retrieve(final.id).output_text == final.output_text  # stored before the end


def test_retrieve_delete_and_input_items(openai_client: openai.OpenAI, model_id: str) -> None:
    items: list[Any] = [{"role": "user", "content": f"Message {i}."} for i in range(5)]
    created = openai_client.responses.create(model=model_id, input=items, max_output_tokens=8, temperature=0,
                                             metadata={"run": "a"})
    retrieved = openai_client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    assert retrieved.metadata == {"run": "a"}
    listed = openai_client.responses.input_items.list(created.id, order="asc")
    assert [i.content[0].text for i in listed.data] == [f"Message {i}." for i in range(5)]
    newest = openai_client.responses.input_items.list(created.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["Message 4.", "Message 3."] and newest.has_more
    rest = openai_client.responses.input_items.list(created.id, limit=5, after=newest.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Message 2.", "Message 1.", "Message 0."]
    assert not rest.has_more
    assert [i.id for i in openai_client.responses.input_items.list(created.id)] == [i.id for i in listed.data][::-1]
    openai_client.responses.delete(created.id)
    for call in (lambda: openai_client.responses.retrieve(created.id),
                 lambda: openai_client.responses.delete(created.id),
                 lambda: openai_client.responses.input_items.list(created.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = openai_client.responses.create(model=model_id, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)


def test_background_responses_are_polled_and_cancelled(openai_client: openai.OpenAI, model_id: str) -> None:
    queued = openai_client.responses.create(model=model_id, input="Say hello.", max_output_tokens=16,
                                            background=True, temperature=0)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = wait_until(openai_client, queued.id, {"completed", "incomplete"})
    assert done.output_text and done.usage is not None
    assert openai_client.responses.cancel(done.id).status == done.status  # an ended response stays as it is

    long = openai_client.responses.create(
        model=model_id, input="List digits.", max_output_tokens=5000, background=True,
        text={"format": {"type": "json_schema", "name": "digits", "schema": LONG}})
    wait_until(openai_client, long.id, {"in_progress"})
    cancelled = openai_client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(2)  # the runner's next renewal would have written a result if the cancel had not stopped it
    assert openai_client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.cancel(openai_client.responses.create(model=model_id, input="x",
                                                                      max_output_tokens=2).id)


def test_truncation_auto_drops_the_oldest_turns(openai_client: openai.OpenAI, model_id: str) -> None:
    """A conversation too long for the context with the output it asks for: refused with truncation disabled;
    with auto, answered from its latest turns."""
    turns: list[Any] = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Fact {i}: " + "the sky is blue and the grass is green. " * 6},
                  {"role": "assistant", "content": "Noted."}]
    turns.append({"role": "user", "content": "Reply with a JSON object."})
    context = 8192  # the embedded model's
    body: dict[str, Any] = {
        "model": model_id, "input": turns, "max_output_tokens": context - 300, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "ok", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}},
    }
    with pytest.raises(openai.BadRequestError, match="context length"):
        openai_client.responses.create(**body)
    response = openai_client.responses.create(**body, truncation="auto")
    assert response.truncation == "auto" and json.loads(response.output_text) in ({"ok": True}, {"ok": False})
    assert response.usage is not None and 150 < response.usage.input_tokens <= 300


def test_input_token_counts_equal_what_a_response_reads(openai_client: openai.OpenAI, model_id: str) -> None:
    """`responses.input_tokens.count` gives the input_tokens the same body's response is billed: with instructions,
    with a tool, continuing a stored response, and with the model left out; an unknown previous id is a 404."""
    bodies: list[dict[str, Any]] = [
        {"input": "Name a colour.", "instructions": "Answer in one word."},
        {"input": "What is the weather in Paris?", "tools": [WEATHER_TOOL]},
    ]
    counts = []
    for body in bodies:
        created = openai_client.responses.create(model=model_id, max_output_tokens=2, **body)
        assert created.usage is not None
        count = openai_client.responses.input_tokens.count(model=model_id, **body)
        assert count.object == "response.input_tokens" and count.input_tokens == created.usage.input_tokens
        counts.append(count.input_tokens)
    assert counts[1] > counts[0] and openai_client.responses.input_tokens.count(**bodies[0]).input_tokens == counts[0]
    follow = {"input": "And another?", "previous_response_id": created.id}
    counted = openai_client.responses.input_tokens.count(model=model_id, **follow).input_tokens
    continued = openai_client.responses.create(model=model_id, max_output_tokens=2, **follow)
    alone = openai_client.responses.input_tokens.count(model=model_id, input="And another?").input_tokens
    assert continued.usage is not None and counted == continued.usage.input_tokens > alone
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.input_tokens.count(model=model_id, input="x", previous_response_id="resp_unknown")


def test_errors_in_openais_shape(gateway_http: httpx.Client, model_id: str) -> None:
    def error(status: int, body: dict[str, Any], method: str = "POST", path: str = "/v1/responses") -> Any:
        reply = gateway_http.request(method, path, json=body if method == "POST" else None)
        assert reply.status_code == status, reply.text
        return reply.json()["error"]

    unknown = error(404, {"model": model_id, "input": "x", "previous_response_id": "resp_" + "0" * 32})
    assert unknown["param"] == "previous_response_id" and unknown["code"] == "not_found"
    hosted = error(400, {"model": model_id, "input": "x", "tools": [{"type": "web_search"}]})
    assert hosted["param"] == "tools[0].type" and "web_search" in hosted["message"]
    image = error(400, {"model": model_id, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-abc"}]}]})
    assert image["param"] == "input[0].content[0].file_id"
    assert error(400, {"model": model_id, "input": "x", "background": True, "store": False})["param"] == "store"
    assert error(404, {"model": "gpt-4o", "input": "x"})["code"] == "model_not_found"
    assert error(400, {"model": model_id, "input": "x", "include": ["everything"]})["param"] == "include"
    assert error(404, {"model": model_id, "input": "x", "conversation": "conv_1"})["param"] == "conversation"
    assert error(400, {"model": model_id, "input": "x", "prompt": {"id": "pmpt_1"}})["param"] == "prompt"
    for path in ("/v1/responses/resp_nope", "/v1/responses/" + "resp_" + "f" * 32):
        assert error(404, {}, "GET", path)["code"] == "not_found"


def test_a_batch_of_responses_lines(openai_client: openai.OpenAI, model_id: str, tmp_path: Path) -> None:
    """Lines for /v1/responses (and /responses) run through the engine's Batch RPC; each result is the Response
    the route would have answered."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses" if i % 2 else "/responses",
              "body": {"model": model_id, "input": f"Say the number {i}.", "max_output_tokens": 8, "temperature": 0}}
             for i in range(6)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with path.open("rb") as f:
        upload = openai_client.files.create(file=f, purpose="batch")
    batch = openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := openai_client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 6 and batch.output_file_id is not None
    results = [json.loads(line) for line in openai_client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(6)]
    for result in results:
        body = result["response"]["body"]
        assert result["response"]["status_code"] == 200 and body["object"] == "response"
        assert body["status"] in ("completed", "incomplete") and body["output"][0]["type"] == "message"
        assert body["store"] is False


def test_streamed_tool_calls_and_logprobs(openai_client: openai.OpenAI, model_id: str) -> None:
    with openai_client.responses.stream(model=model_id, input="Weather in Rome?", tools=[WEATHER_TOOL],
                                        tool_choice="required", max_output_tokens=100, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == call.arguments == done[0].arguments and done[0].item_id == call.id
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])

    scored = openai_client.responses.create(model=model_id, input="Hi", max_output_tokens=5, temperature=0,
                                            include=["message.output_text.logprobs"], top_logprobs=2)
    part = scored.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == scored.usage.output_tokens  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
