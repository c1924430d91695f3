"""What every adversarial case checks besides its own error: the gRPC error's code and field, and that the engine
and gateway still serve the next valid request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import httpx

from ladle.v1 import engine_pb2_grpc, types_pb2
from tests.e2e.helpers import generate

PARAM_KEY = "ladle-param"  # trailing metadata naming the offending field (engine_server.server.servicer)
HELLO = [{"role": "user", "content": "Hello"}]


def rpc_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The RpcError `call(*args, **kwargs)` raises; fails the test if it succeeds."""
    try:
        call(*args, **kwargs)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{call} succeeded; an error was expected")


def assert_rpc_error(
    error: grpc.RpcError, code: grpc.StatusCode, param: str | None, fragment: str
) -> None:
    """`error` has `code`, names `param` in its trailing metadata (none when None) and says `fragment`."""
    assert error.code() is code, (error.code(), error.details())
    details = error.details() or ""
    assert fragment in details, details
    metadata = dict(error.trailing_metadata() or ())
    assert metadata.get(PARAM_KEY) == param, (metadata, details)
    if param is not None:
        assert param in details, details


def still_serves_grpc(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    """A small greedy Generate succeeds with one finished choice."""
    reply = stub.Generate(generate("The capital of France is", 2), timeout=120)
    (choice,) = reply.choices
    assert len(choice.token_ids) == 2 and choice.finish_reason == types_pb2.FINISH_REASON_LENGTH


def still_serves_http(http: httpx.Client, model: str) -> None:
    """A small chat completion through the gateway succeeds."""
    response = http.post("/v1/chat/completions", json={"model": model, "messages": HELLO, "max_tokens": 2,
                                                       "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def raw_json(**fields: str) -> bytes:
    """A JSON object whose values are given as raw JSON text (for NaN / Infinity literals, huge numbers...)."""
    return ("{" + ", ".join(f'"{name}": {text}' for name, text in fields.items()) + "}").encode()
