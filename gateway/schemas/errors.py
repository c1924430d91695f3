"""OpenAI's error body as a pydantic model, for the OpenAPI document: every error answer has this shape
(`gateway.errors.APIError.body`), whatever its status."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


# The app's `responses`: documents the error shape for every route, in place of FastAPI's 422 (never sent here;
# a body that fails validation is a 400).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "default": {"model": ErrorResponse, "description": "An error, in OpenAI's shape (any 4xx or 5xx status)"},
}
