"""Prompts and request shapes past their limits: empty prompts and conversations, 100,000 stop strings, 10,000
prompts in one request, duplicate request ids in flight, template variables the operator did not allow."""

from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.adversarial.helpers import HELLO, assert_rpc_error, rpc_error, still_serves_grpc, still_serves_http
from tests.e2e.helpers import assert_error, chat_input, generate, joined_stream, sampling, stream

pytestmark = pytest.mark.slow

Stub = engine_pb2_grpc.EngineServiceStub
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def message(error: dict[str, Any]) -> str:
    text: str = error["message"]
    return text


def request(input_: types_pb2.Input, max_tokens: int = 2) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(input=input_, sampling=sampling(max_tokens))


def test_empty_prompt_and_empty_messages(http: httpx.Client, stub: Stub, model_id: str) -> None:
    for prompt in ("", [], ["", "Hi"]):
        assert message(assert_error(http.post("/v1/completions", json={"model": model_id, "prompt": prompt}),
                                    400, "prompt")) == "prompt must not be empty"
    no_tokens = http.post("/v1/completions", json={"model": model_id, "prompt": [[]]})
    assert message(assert_error(no_tokens, 400, "prompt")) == "empty prompt: at least one prompt token is required"
    no_messages = http.post("/v1/chat/completions", json={"model": model_id, "messages": []})
    assert message(assert_error(no_messages, 400, "messages")) == (
        "messages: List should have at least 1 item after validation, not 0")
    no_conversation = http.post("/v1/chat/completions/batch", json={"model": model_id, "messages": [HELLO, []]})
    assert message(assert_error(no_conversation, 400, "messages[1]")) == "conversation 1 has no messages"

    assert_rpc_error(rpc_error(stub.Generate, request(types_pb2.Input(text="")), timeout=60), INVALID, "prompt",
                     "prompt must not be empty")
    no_ids = request(types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[])))
    assert_rpc_error(rpc_error(stub.Generate, no_ids, timeout=60), INVALID, "prompt",
                     "empty prompt: at least one prompt token is required")
    no_chat = request(types_pb2.Input(chat=types_pb2.ChatInput()))
    assert_rpc_error(rpc_error(stub.Generate, no_chat, timeout=60), INVALID, "messages", "messages must not be empty")
    assert_rpc_error(rpc_error(stub.Generate, request(types_pb2.Input()), timeout=60), INVALID, "input",
                     "input must set one of text, chat, token_ids or transcription")
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_100000_stop_strings(http: httpx.Client, stub: Stub, model_id: str) -> None:
    stops = [f"s{i}" for i in range(100_000)]
    response = http.post("/v1/chat/completions", json={"model": model_id, "messages": HELLO, "stop": stops})
    assert message(assert_error(response, 400, "stop")) == "at most 16 stop sequences are allowed, got 100000"
    assert_rpc_error(rpc_error(stub.Generate, generate("Hi", 2, stop=stops), timeout=60), INVALID, "stop",
                     "at most 16 stop sequences are allowed, got 100000")
    long_stop = http.post("/v1/chat/completions", json={"model": model_id, "messages": HELLO, "stop": ["x" * 257]})
    assert message(assert_error(long_stop, 400, "stop")) == "stop sequences must be at most 256 characters, got 257"
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_10000_item_prompt_lists(http: httpx.Client, stub: Stub, model_id: str) -> None:
    for prompts in (["Hi"] * 10_000, [[1, 2]] * 10_000):
        for streamed in (False, True):
            body = {"model": model_id, "prompt": prompts, "max_tokens": 1, "stream": streamed}
            refused = assert_error(http.post("/v1/completions", json=body), 400, "prompt")
            assert message(refused) == "prompt holds 10000 prompts; at most 512 are allowed in one request"
    # More prompts than the engine takes at once (twice its 32 seats) are fed to it a window at a time.
    served = http.post("/v1/completions", json={"model": model_id, "prompt": [f"{i}:" for i in range(70)],
                                                "max_tokens": 1, "temperature": 0})
    assert served.status_code == 200, served.text
    assert sorted(c["index"] for c in served.json()["choices"]) == list(range(70))
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_duplicate_request_ids_in_flight(http: httpx.Client, stub: Stub, model_id: str) -> None:
    """Request ids are the caller's labels: two calls with one id run independently, and cancelling one leaves
    the other alone. Only a Batch call's item ids must be unique (results are matched to items by them)."""
    first = stub.Stream(stream("Story one:", 400, request_id="dup", ignore_eos=True), timeout=120)
    second = stub.Stream(stream("Story two:", 12, request_id="dup", ignore_eos=True), timeout=120)
    assert next(first).request_id == "dup"
    first.cancel()
    responses = list(second)
    assert all(r.request_id == "dup" for r in responses)
    _, ids, finish = joined_stream(responses)[0]
    assert len(ids) == 12 and finish == types_pb2.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as cancelled:
        list(first)
    assert cancelled.value.code() is grpc.StatusCode.CANCELLED

    items = [engine_pb2.BatchRequest(item_id="same", request=generate("Hi", 2)) for _ in range(2)]
    outcomes = list(stub.Batch(iter(items), timeout=120))
    assert sorted(r.WhichOneof("outcome") for r in outcomes) == ["error", "result"]
    (error,) = [r.error for r in outcomes if r.HasField("error")]
    assert (error.code, error.param) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "item_id")
    assert error.message == "item_id 'same' was already used in this call"

    replies: list[httpx.Response] = []
    body = {"model": model_id, "messages": HELLO, "max_tokens": 4, "temperature": 0}
    calls = [threading.Thread(target=lambda: replies.append(
        http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "dup-http"}))) for _ in range(2)]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    assert [r.status_code for r in replies] == [200, 200]
    assert {r.headers["x-request-id"] for r in replies} == {"dup-http"}
    assert replies[0].json()["choices"] == replies[1].json()["choices"]
    still_serves_grpc(stub)


def test_unexpected_chat_template_kwargs(http: httpx.Client, stub: Stub, model_id: str) -> None:
    def chat(kwargs: Any) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"model": model_id, "messages": HELLO, "max_tokens": 2,
                                                       "chat_template_kwargs": kwargs})

    refused = assert_error(chat({"chat_template": "{{ 7 * 7 }}", "messages": []}), 400, "chat_template_kwargs")
    assert message(refused) == ("chat_template_kwargs keys ['chat_template', 'messages'] are not allowed (allowed: "
                                "add_generation_prompt, enable_thinking, reasoning_effort, thinking)")
    assert message(assert_error(chat([1]), 400, "chat_template_kwargs")) == (
        "chat_template_kwargs: Input should be a valid dictionary")
    assert message(assert_error(chat({"add_generation_prompt": "yes"}), 400, "chat_template_kwargs")) == (
        "chat_template_kwargs.add_generation_prompt must be true or false")
    assert chat({"add_generation_prompt": False, "enable_thinking": True}).status_code == 200

    def grpc_chat(kwargs_json: str) -> engine_pb2.GenerateRequest:
        conversation = chat_input("Hello")
        conversation.chat.chat_template_kwargs_json = kwargs_json
        return request(conversation)

    for kwargs_json, fragment in [
        ('{"messages": []}', "chat_template_kwargs keys ['messages'] are not allowed"),
        ('{"add_generation_prompt": false}', "chat_template_kwargs keys ['add_generation_prompt'] are not allowed"),
        ("[1]", "chat_template_kwargs_json must be a JSON object"),
        ("{nope", "chat_template_kwargs is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "chat_template_kwargs is nested too deeply to parse"),
    ]:
        assert_rpc_error(rpc_error(stub.Generate, grpc_chat(kwargs_json), timeout=60), INVALID,
                         "chat_template_kwargs", fragment)
    assert stub.Generate(grpc_chat(json.dumps({"enable_thinking": False})), timeout=60).choices
    still_serves_http(http, model_id)
    still_serves_grpc(stub)
