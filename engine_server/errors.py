"""Typed engine errors; the gRPC layer maps each class to one status code."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for errors the engine reports to a caller (never a crash of the step loop)."""


class ValidationError(EngineError, ValueError):
    """The request is malformed or out of range (gRPC INVALID_ARGUMENT, HTTP 400).

    `param` names the offending field in the caller's vocabulary (e.g. "max_tokens"), when there is one.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelTemplateError(EngineError):
    """The model's own chat template failed in a way no request can fix: its sandbox refused an operation the
    template attempted (gRPC FAILED_PRECONDITION, HTTP 500). The operator must replace the template."""


class UnsupportedByModelError(EngineError):
    """The served model cannot do what the call asks: an encoder (which only pools) asked to generate (gRPC
    UNIMPLEMENTED, HTTP 400)."""


class QueueFullError(EngineError):
    """The waiting queue is over its limit (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class EngineUnavailableError(EngineError):
    """The engine is not ready or is draining (gRPC UNAVAILABLE, HTTP 503)."""


class AdapterNotFoundError(EngineError):
    """No LoRA adapter of the requested name is served (gRPC NOT_FOUND, HTTP 404 `model_not_found`)."""


class AdapterExistsError(EngineError):
    """An adapter of that name is served already (gRPC ALREADY_EXISTS, HTTP 400)."""


class LoraDisabledError(EngineError):
    """The engine was started without LoRA, so it loads no adapter (gRPC FAILED_PRECONDITION, HTTP 400)."""
