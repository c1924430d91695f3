"""Bodies that schema fuzzing (tests/fuzz) found the engine's request cannot carry: each is a 400 naming the
field, from the schema or the translation, never protobuf's ValueError (a 500)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.batches.lines import InvalidLineError, parse_line
from gateway.errors import APIError, validation_param
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.common import INT32_MAX, UINT32_MAX
from gateway.schemas.completions import CompletionRequest
from gateway.translate import to_engine

HELLO = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": UINT32_MAX + 1}, "max_tokens"),
        ({"max_completion_tokens": UINT32_MAX + 1}, "max_completion_tokens"),
        ({"min_tokens": UINT32_MAX + 1}, "min_tokens"),
        ({"top_k": INT32_MAX + 1}, "top_k"),
        ({"stop_token_ids": [7, -1]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [UINT32_MAX + 1]}, "stop_token_ids[0]"),
        ({"logit_bias": {"--5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"²": 1.0}}, "logit_bias"),  # str.isdigit() is true for it, int() refuses it
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {str(UINT32_MAX + 1): 1.0}}, "logit_bias"),
        ({"logit_bias": {"1" * 5000: 1.0}}, "logit_bias"),  # past int()'s digit limit
        ({"seed": 2**63}, "seed"),
    ],
)
def test_values_beyond_the_protos_fields_are_refused_by_the_schema(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as refused:
        chat(**fields)
    assert validation_param(tuple(refused.value.errors()[0]["loc"])) == param


def test_the_widest_values_the_schema_admits_fit_the_proto() -> None:
    body = chat(max_tokens=UINT32_MAX, min_tokens=UINT32_MAX, top_k=INT32_MAX, stop_token_ids=[UINT32_MAX],
                logit_bias={str(UINT32_MAX): 1.0}, seed=-(2**63))
    params = to_engine.chat_request(body, body.messages, "r").sampling
    assert (params.max_tokens, params.min_tokens, params.top_k) == (UINT32_MAX, UINT32_MAX, INT32_MAX)
    assert params.seed == 0 and dict(params.logit_bias) == {UINT32_MAX: 1.0}


def test_prompt_token_ids_beyond_uint32_are_a_400() -> None:
    with pytest.raises(APIError) as refused:
        to_engine.completion_requests(completion(prompt=[1, UINT32_MAX + 1]), "r")
    assert (refused.value.status, refused.value.param) == (400, "prompt")


@pytest.mark.parametrize(
    "body",
    [
        chat(messages=[{"role": "user", "content": "a\ud800"}]),
        chat(stop=["\udfff"]),
        chat(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}]),
        completion(prompt="\ud800"),
        completion(prompt=["ok", "\ud800"]),
    ],
)
def test_lone_surrogates_are_a_400(body: ChatCompletionRequest | CompletionRequest) -> None:
    with pytest.raises(APIError, match="not valid Unicode") as refused:
        if isinstance(body, ChatCompletionRequest):
            to_engine.chat_request(body, body.messages, "r")
        else:
            to_engine.completion_requests(body, "r")
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "body_text",
    [
        '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        '{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [-1]}',
        '{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4294967296}',
    ],
)
def test_a_batch_line_the_engine_cannot_take_is_an_invalid_line(body_text: str) -> None:
    """The batch worker validates lines with the same schema and translation: such a line is refused, it does
    not raise out of validation."""
    raw = f'{{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {body_text}}}'.encode()
    with pytest.raises(InvalidLineError) as refused:
        parse_line(raw, 1, 0, "/v1/chat/completions", "m")
    assert refused.value.error.code == "invalid_body"
