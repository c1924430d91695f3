"""The gateway's OpenAPI document says what the gateway does (schemathesis fuzzes it, tests/fuzz): errors in
OpenAI's shape on every route and never FastAPI's 422, the multipart body of an upload, SSE where a route
streams, and the proto's widths as the bounds of counts and token ids."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.schemas.common import UINT32_MAX


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(GatewayConfig(engines=("127.0.0.1:1",))).openapi()


def test_every_operation_documents_the_openai_error_shape_and_no_422(document: dict[str, Any]) -> None:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            error = responses["default"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
    detail = document["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}


def test_bodies_and_media_types(document: dict[str, Any]) -> None:
    paths = document["paths"]
    upload = paths["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["file", "purpose"] and "batch" in upload["properties"]["purpose"]["enum"]
    for route in ("/v1/chat/completions", "/v1/completions"):
        content = paths[route]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        # Per event, as schemathesis (and OpenAPI 3.2's itemSchema) reads an event stream's schema: a parsed event
        # is {"data": ..., "event": "message"}; a schema of the whole body as a string failed every streamed 200.
        event = content["text/event-stream"]["schema"]
        assert event["type"] == "object" and event["required"] == ["data"]
    assert set(paths["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]) == {
        "application/octet-stream"}
    sampling = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert sampling["max_tokens"]["anyOf"][0]["maximum"] == UINT32_MAX
    assert sampling["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == UINT32_MAX


def test_the_pooling_routes_are_documented_once(document: dict[str, Any]) -> None:
    paths = document["paths"]
    for route, schema in (("/v1/embeddings", "EmbeddingRequest"), ("/v1/score", "ScoreRequest"),
                          ("/v1/rerank", "RerankRequest")):
        body = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{schema}"}
    assert not {"/score", "/rerank", "/v2/rerank"} & set(paths)  # vLLM's other paths serve, undocumented
    embedding = document["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert embedding["dimensions"]["anyOf"][0]["maximum"] == UINT32_MAX
