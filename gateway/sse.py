"""Server-sent events as OpenAI sends them: `data: <json>` events, `data: [DONE]` at the end, and an error
event (then no [DONE]) when a stream fails after it started; `response` is the HTTP response that carries them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi.responses import StreamingResponse

from gateway import json_output
from gateway.errors import APIError

log = structlog.get_logger(__name__)

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
# One server-sent event as the HTML standard parses it (an OpenAPI 3.0/3.1 `schema` of text/event-stream describes
# each event, as 3.2's `itemSchema` does): `data` is a JSON chunk, an error body, or `[DONE]`.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer", "minimum": 0}},
}
# For the OpenAPI document of a route that streams when asked: its 200 is JSON or an event stream.
STREAMING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
          "description": "The whole answer (JSON), or with `stream: true` its chunks as server-sent events"},
}


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json_output.dumps(data).encode() + b"\n\n"  # no NaN tokens, whatever the engine sent


async def with_done(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Encode `chunks` as events and end with [DONE]; a failure mid-stream becomes an error event instead."""
    try:
        async for chunk in chunks:
            yield event(chunk)
    except APIError as error:
        log.info("stream failed after it started", status=error.status, reason=error.message)
        yield event(error.body())
        return
    except Exception as exc:
        log.error("stream failed unexpectedly", exc_info=exc)
        yield event(APIError(500, "internal error in the gateway", type="server_error").body())
        return
    yield DONE


def response(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """The HTTP response that streams `chunks` as events (`with_done`), unbuffered by proxies."""
    return StreamingResponse(with_done(chunks), media_type="text/event-stream", headers=HEADERS)


def named_event(data: dict[str, Any]) -> bytes:
    """An event whose `event:` field is its data's `type`, as the Responses API sends them."""
    return b"event: " + str(data["type"]).encode() + b"\n" + event(data)


async def _named(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for data in events:
            yield named_event(data)
    except Exception as exc:
        log.error("stream failed unexpectedly", exc_info=exc)
        error = APIError(500, "internal error in the gateway", type="server_error")
        yield named_event({"type": "error", "code": error.type, "message": error.message, "param": None})


def named_response(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """The HTTP response that streams typed events (the Responses API's): no [DONE] at the end, the last event
    says how the stream ended."""
    return StreamingResponse(_named(events), media_type="text/event-stream", headers=HEADERS)
