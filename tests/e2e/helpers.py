"""Small builders of ladle.v1 requests, and the check of OpenAI's error shape, shared by the end-to-end tests."""

from __future__ import annotations

from typing import Any

import httpx

from ladle.v1 import engine_pb2, types_pb2


def sampling(max_tokens: int = 8, **fields: Any) -> types_pb2.SamplingParams:
    """Greedy unless told otherwise."""
    return types_pb2.SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **fields})


def text_input(text: str) -> types_pb2.Input:
    return types_pb2.Input(text=text)


def chat_input(*user_turns: str) -> types_pb2.Input:
    messages = [types_pb2.ChatMessage(role="user", content=t) for t in user_turns]
    return types_pb2.Input(chat=types_pb2.ChatInput(messages=messages))


def generate(text: str, max_tokens: int = 8, request_id: str = "", **fields: Any) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id, input=text_input(text), sampling=sampling(max_tokens, **fields)
    )


def stream(text: str, max_tokens: int = 8, request_id: str = "", **fields: Any) -> engine_pb2.StreamRequest:
    return engine_pb2.StreamRequest(
        request_id=request_id, input=text_input(text), sampling=sampling(max_tokens, **fields)
    )


def joined_stream(responses: list[engine_pb2.StreamResponse]) -> dict[int, tuple[str, list[int], int]]:
    """Per choice index: (text, token ids, last finish reason) of a whole stream."""
    out: dict[int, tuple[str, list[int], int]] = {}
    for response in responses:
        for delta in response.choices:
            text, ids, _ = out.get(delta.index, ("", [], 0))
            out[delta.index] = (text + delta.text, ids + list(delta.token_ids), delta.finish_reason)
    return out


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The response is `status` with exactly OpenAI's error body; returns the inner error."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error
