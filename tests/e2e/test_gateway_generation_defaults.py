"""A new user's first request: no sampling fields at all, through the real gateway, on the embedded model."""

from __future__ import annotations

import httpx

EMBEDDED_MAX_TOKENS = 512  # the embedded model's default cap (engine_server.generation_defaults)


def test_a_chat_request_without_sampling_fields_ends_within_the_default_cap(
    gateway_http: httpx.Client, model_id: str
) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    response = gateway_http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    (choice,) = reply["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["content"]
    assert 0 < reply["usage"]["completion_tokens"] <= EMBEDDED_MAX_TOKENS
