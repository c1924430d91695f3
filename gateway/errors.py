"""Every failure the gateway reports, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`APIError` is raised anywhere in a request; `install_error_handlers` turns it, FastAPI's validation errors,
unknown routes and unexpected exceptions into that shape. `from_rpc_error` maps an engine's gRPC status to the
HTTP status a client of the OpenAI API expects, `item_error` a failed Batch item's likewise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import pydantic
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ladle.v1 import engine_pb2

log = structlog.get_logger(__name__)

PARAM_METADATA_KEY = "ladle-param"  # set by the engine on INVALID_ARGUMENT (engine_server.server.servicer)


class APIError(Exception):
    """An error answered with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400 for a request the gateway itself refuses."""
    return APIError(400, message, param=param)


def no_engine(message: str = "no engine is ready to serve requests; retry shortly") -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="engine_unavailable")


def draining() -> APIError:
    """/health's answer while the gateway drains (`--drain-grace`): it still serves, but is leaving rotation."""
    message = "this gateway is stopping; it serves until its drain grace ends"
    return APIError(503, message, type="service_unavailable_error", code="draining")


MAX_NAMED_ADAPTERS = 10  # in an unknown model's message; GET /v1/models lists every one


def unknown_model_message(requested: str, model_id: str, adapters: Sequence[str]) -> str:
    """Why `requested` names no model here: the served model `model_id` and its LoRA `adapters` are the ones."""
    served = f"`{model_id}`"
    if adapters:
        served += " and its LoRA adapters " + ", ".join(f"`{name}`" for name in adapters[:MAX_NAMED_ADAPTERS])
    if len(adapters) > MAX_NAMED_ADAPTERS:
        served += f" and {len(adapters) - MAX_NAMED_ADAPTERS} more (GET /v1/models)"
    return f"The model `{requested}` does not exist; this gateway serves {served}."


def model_not_found(message: str) -> APIError:
    """The 404 for a `model` that names neither the served model nor one of its LoRA adapters (OpenAI's code)."""
    return APIError(404, message, param="model", code="model_not_found")


def engine_refused(details: str, engine: str | None = None) -> APIError:
    """503 for an engine that refuses the gateway's token (UNAUTHENTICATED): the operator's to fix, not the
    caller's, so neither 401 nor 403."""
    where = f" at {engine}" if engine else ""
    return no_engine(f"the engine{where} refuses this gateway's calls (UNAUTHENTICATED: {details}); the "
                     "gateway's --engine-auth-token-file must hold the engine's token")


def message_too_large(details: str) -> bool:
    """Whether a RESOURCE_EXHAUSTED status is grpc's refusal of a message over the channel's size limit (rather than
    the engine refusing a request for load)."""
    return "message larger than max" in details


def from_rpc_error(error: grpc.aio.AioRpcError | grpc.RpcError, retry_after_s: int = 1) -> APIError:
    """The HTTP error for an engine call that ended with a non-OK status."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    return from_status(code, details, _param(error), retry_after_s)


def from_status(
    code: grpc.StatusCode, details: str, param: str | None = None, retry_after_s: int = 1
) -> APIError:
    """The HTTP error for a gRPC status code and its message."""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, details, param=param)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and message_too_large(details):
        return APIError(500, f"the reply is larger than the gRPC message limit ({details}); ask for fewer tokens, "
                        "choices (n) or top_logprobs", type="server_error", code="reply_too_large")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(
            429, details, type="rate_limit_error", code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return no_engine(f"the engine is unavailable: {details}")
    if code is grpc.StatusCode.UNAUTHENTICATED:  # only ever the engine refusing the gateway's own token
        return engine_refused(details)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"the request timed out: {details}", type="timeout_error", code="timeout")
    if code is grpc.StatusCode.NOT_FOUND:  # the engine serves no LoRA adapter of the requested name (any more)
        return model_not_found(details)
    if code is grpc.StatusCode.UNIMPLEMENTED:  # the served model cannot do this: an encoder asked to generate
        return APIError(400, details, code="unsupported_by_model")
    if code is grpc.StatusCode.CANCELLED:
        return APIError(499, "the request was cancelled", type="cancelled_error", code="cancelled")
    return APIError(500, f"the engine failed: {details}", type="server_error", code="internal_error")


def item_error(error: engine_pb2.ItemError, retry_after_s: int = 1, where: str | None = None) -> APIError:
    """The HTTP error for a Batch item that failed with `error`. `where` (e.g. `messages[3]`) names the item in
    the message, and is the param when the engine names none."""
    message = f"{where}: {error.message}" if where else error.message
    return from_status(grpc_status(error.code), message, error.param or where, retry_after_s)


def grpc_status(value: int) -> grpc.StatusCode:
    """The status code for its number (as a Batch item's ItemError carries it); UNKNOWN for an unknown one."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def _param(error: grpc.RpcError) -> str | None:
    trailing: Any = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == PARAM_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def validation_param(loc: tuple[int | str, ...]) -> str | None:
    """OpenAI-style param for a pydantic error location: ("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = [p for p in loc if p != "body"]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not part.startswith(("function-", "union[", "tagged-union[")) and "[" not in part:
            text += f".{part}" if text else part
    return text or None


def invalid_body(exc: pydantic.ValidationError, prefix: str = "") -> APIError:
    """The 400 for a body that a route re-reads with another schema (a Responses body as chat, a tokenize body's
    messages; a part of a body, its field named after `prefix`): its first error, naming the field."""
    first = exc.errors()[0]
    param = validation_param(tuple(first.get("loc", ())))
    param = f"{prefix}.{param}" if prefix else param
    return invalid(f"{param}: {first.get('msg', 'invalid value')}", param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape (never FastAPI's default 422 body)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        log.info("request refused", status=exc.status, reason=exc.message, param=exc.param)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = validation_param(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif tuple(first.get("loc", ())) == ("body",):
            message, param = "the request body must be a JSON object (Content-Type: application/json)", None
        elif param:
            message = f"{param}: {message}"
        log.info("request refused", status=400, reason=message, param=param)
        return invalid(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            error = APIError(405, f"method {request.method} is not allowed on {request.url.path}")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        error.headers.update(exc.headers or {})
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error", exc_info=exc)
        return APIError(500, "internal error in the gateway", type="server_error", code="internal_error").response()
