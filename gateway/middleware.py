"""The ASGI layer around every HTTP request: request id, log context, API key and project, body-size limit,
request metrics, and (with tracing on) the request's span.

Written as plain ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched and the request
counts as in flight until its last SSE byte is sent.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Iterator

import structlog
from opentelemetry import trace
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.calls import served_by
from gateway.deps import authenticate, authorize_metrics
from gateway.errors import APIError
from gateway.keys import KeyRing
from gateway.metrics import GatewayMetrics
from ladle.tracing import extract, set_attributes, trace_id

log = structlog.get_logger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")  # safe to echo and to use as an engine request id
KNOWN_ROUTES = frozenset({
    "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/chat/completions/batch", "/v1/embeddings",
    "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/files", "/v1/batches", "/health", "/metrics",
    "/v1/responses", "/v1/organization/usage/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/v1/responses/input_tokens", "/v1/conversations", "/tokenize", "/detokenize", "/version",
    "/v1/audio/transcriptions", "/v1/audio/translations",
})
# Routes that read their body as a stream and cap it themselves (uploads may be far larger than a request; an audio
# clip is capped by --max-audio-mib).
OWN_BODY_LIMIT = frozenset({"/v1/files", "/v1/audio/transcriptions", "/v1/audio/translations"})
# Paths answered without the API key: load balancers' health checks, the API's public description, the version.
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/version"})
METRICS_PATH = "/metrics"  # the operator's key only (deps.authorize_metrics), not any project's


def route_label(path: str) -> str:
    """A bounded metrics label: the route, or "other" for unknown paths; ids become placeholders."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/files/"):
        return "/v1/files/{file_id}/content" if path.endswith("/content") else "/v1/files/{file_id}"
    if path.startswith("/v1/batches/"):
        return "/v1/batches/{batch_id}/cancel" if path.endswith("/cancel") else "/v1/batches/{batch_id}"
    if path.startswith("/v1/responses/"):
        for tail in ("/cancel", "/input_items"):
            if path.endswith(tail):
                return "/v1/responses/{response_id}" + tail
        return "/v1/responses/{response_id}"
    if path.startswith("/v1/conversations/"):
        if "/items/" in path:
            return "/v1/conversations/{conversation_id}/items/{item_id}"
        if path.endswith("/items"):
            return "/v1/conversations/{conversation_id}/items"
        return "/v1/conversations/{conversation_id}"
    return "other"


class RequestContextMiddleware:
    """Binds a request id (the caller's X-Request-Id when valid, else a new one) into `scope["state"]`, the log
    context and the response headers; outside PUBLIC_PATHS, puts the project of the request's API key into
    `scope["state"]["project"]`, or refuses a request without a valid key (when `keys` has any) with 401 before
    reading its body; then bodies over `max_request_bytes` with 413; counts requests; adds the rate-limit headers
    an admitted request was given (`RateLimiter.admit`) to its response."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, max_request_bytes: int, keys: KeyRing,
                 tracer: trace.Tracer | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.keys = keys
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        incoming = headers.get(REQUEST_ID_HEADER, "")
        request_id = incoming if _VALID_REQUEST_ID.match(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        route = route_label(scope["path"])
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                limits = scope["state"].get("ratelimit_headers", {})  # set by RateLimiter.admit
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode()),
                                      *((k.encode(), v.encode()) for k, v in limits.items())]
            await send(message)

        engines: list[str] = []
        token = served_by.set(engines)
        with structlog.contextvars.bound_contextvars(request_id=request_id, route=route), \
                self._span(scope, headers, route, request_id) as span:
            started = time.monotonic()
            self.metrics.in_flight.inc()
            try:
                with self.metrics.working():
                    await self._admit(scope, headers, receive, send_with_id)
            finally:
                if span is not None:
                    set_attributes(span, {"http.response.status_code": status,
                                          "ladle.project": scope["state"].get("project")})
                    if status >= 500:
                        span.set_status(trace.StatusCode.ERROR)
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(route, str(status)).inc()
                log.info("request finished", method=scope["method"], path=scope["path"], status=status,
                         duration_ms=round((time.monotonic() - started) * 1000, 1),
                         **({"engines": list(dict.fromkeys(engines))} if engines else {}))
                served_by.reset(token)

    @contextlib.contextmanager
    def _span(self, scope: Scope, headers: Headers, route: str, request_id: str) -> Iterator[trace.Span | None]:
        """The request's span while it runs (None when tracing is off): a child of the caller's `traceparent` if
        it sent one, current for everything the request does (its engine calls carry it on), its trace id in the
        log context."""
        if self.tracer is None:
            yield None
            return
        attributes = {"http.request.method": scope["method"], "http.route": route, "ladle.request_id": request_id}
        with self.tracer.start_as_current_span(f"{scope['method']} {route}", context=extract(headers.items()),
                                               kind=trace.SpanKind.SERVER, attributes=attributes) as span, \
                structlog.contextvars.bound_contextvars(trace_id=trace_id(span)):
            yield span

    async def _admit(self, scope: Scope, headers: Headers, receive: Receive, send: Send) -> None:
        """Run the app, unless the request lacks the API key (401, its body unread) or its body is too large."""
        path = scope["path"]
        refusal = None
        if path == METRICS_PATH:
            refusal = authorize_metrics(headers.get("authorization", ""), self.keys)
        elif path not in PUBLIC_PATHS:
            outcome = authenticate(headers.get("authorization", ""), self.keys)
            if isinstance(outcome, APIError):
                refusal = outcome
            else:
                scope["state"]["project"] = outcome
        if refusal is None:
            body_receive = await self._limited(path, headers, receive)
            if body_receive is not None:
                await self.app(scope, body_receive, send)
                return
            refusal = APIError(413, f"the request body is larger than {self.max_request_bytes} bytes",
                               code="request_too_large")
        await refusal.response()(scope, receive, send)

    async def _limited(self, path: str, headers: Headers, receive: Receive) -> Receive | None:
        """`receive` if the body fits (None if not). A body without Content-Length is read here and replayed,
        except on the routes that limit their bodies as they stream them."""
        if path in OWN_BODY_LIMIT:
            return receive
        length = headers.get("content-length")
        if length is not None:
            return receive if length.isdigit() and int(length) <= self.max_request_bytes else None
        if "transfer-encoding" not in headers:
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        return replayed
