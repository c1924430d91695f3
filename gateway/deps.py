"""FastAPI dependencies: the app's shared objects (opened in the lifespan), the API-key check and the project a
request acts for."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from opentelemetry import trace

from gateway.adapters import AdapterRegistry
from gateway.batches.service import BatchService
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.errors import APIError, model_not_found, unknown_model_message
from gateway.keys import KeyRing
from gateway.media import MediaFetcher
from gateway.metrics import GatewayMetrics
from gateway.rate_limits import Admission, RateLimiter
from gateway.responses.service import ResponseService
from gateway.store.tables import DEFAULT_PROJECT
from ladle.v1 import types_pb2


def get_pool(request: Request) -> EnginePool:
    pool: EnginePool = request.app.state.pool
    return pool


def get_metrics(request: Request) -> GatewayMetrics:
    metrics: GatewayMetrics = request.app.state.metrics
    return metrics


def get_batches(request: Request) -> BatchService:
    batches: BatchService = request.app.state.batches
    return batches


def get_responses(request: Request) -> ResponseService:
    responses: ResponseService = request.app.state.responses
    return responses


def get_adapters(request: Request) -> AdapterRegistry:
    adapters: AdapterRegistry = request.app.state.adapters
    return adapters


def get_media(request: Request) -> MediaFetcher:
    media: MediaFetcher = request.app.state.media
    return media


def get_limiter(request: Request) -> RateLimiter:
    limiter: RateLimiter = request.app.state.limiter
    return limiter


async def admit(request: Request, project: str, output_cap: int | None) -> Admission | None:
    """Count the request against its project's rate limits (`RateLimiter.admit`): 429 over a limit. Its body is
    the one FastAPI read (Starlette keeps it on the request)."""
    return await get_limiter(request).admit(request.state, project, len(await request.body()), output_cap)


def get_config(request: Request) -> GatewayConfig:
    config: GatewayConfig = request.app.state.config
    return config


def get_keys(request: Request) -> KeyRing:
    keys: KeyRing = request.app.state.keys
    return keys


def request_id(request: Request) -> str:
    """The id bound by RequestContextMiddleware (the caller's X-Request-Id or a generated one)."""
    value: str = request.state.request_id
    return value


def call_id(request: Request) -> str:
    """The id of this call's engine request and of its completion (`chatcmpl-<id>`), unique per call: the
    request id when the gateway generated it, else the caller's X-Request-Id with a random suffix. A client's id
    names its trace in logs and headers; two calls that send the same one are still two requests."""
    rid: str = request.state.request_id
    if request.headers.get("x-request-id") != rid:
        return rid
    return f"{rid}-{secrets.token_hex(4)}"


def authenticate(authorization: str, keys: KeyRing) -> str | APIError:
    """The project of the key in an Authorization header value (`Bearer <key>`, compared in constant time by
    `KeyRing.project_of`), or the 401 to answer; the default project when the gateway has no keys."""
    if not keys.required:
        return DEFAULT_PROJECT
    project = keys.project_of(bearer_token(authorization))
    if project is not None:
        return project
    return invalid_api_key()


def bearer_token(authorization: str) -> str:
    """The key of an Authorization header value `Bearer <key>`; "" for any other value (no key is empty)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def invalid_api_key() -> APIError:
    """The 401 for a missing or unknown key: the same on every route, so it tells nothing about the route."""
    return APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def authorize_metrics(authorization: str, keys: KeyRing) -> APIError | None:
    """None if the Authorization header value carries a key that may read /metrics (`KeyRing.may_read_metrics`);
    else the error to answer: 401 without a valid key, 403 for a project's key that is not the operator's."""
    token = bearer_token(authorization)
    if keys.may_read_metrics(token):
        return None
    if token and keys.project_of(token) is not None:
        if keys.has_admin:
            return APIError(403, "This key cannot read /metrics: use an admin key (flagged 'admin' in the keys "
                            "file) or the --metrics-api-key.", code="permission_denied")
        return APIError(403, "This key cannot read /metrics: use the --metrics-api-key (or, without one, a key of "
                        "the project 'default').", code="permission_denied")
    return invalid_api_key()


def request_is_admin(request: Request) -> bool:
    """Whether the request's key may use the operator routes (`KeyRing.is_admin`)."""
    return get_keys(request).is_admin(bearer_token(request.headers.get("authorization", "")))


def require_admin(request: Request) -> None:
    """401 without a valid key, 403 unless the key may use the operator routes (`request_is_admin`)."""
    request_project(request)
    if request_is_admin(request):
        return
    if get_keys(request).has_admin:
        hint = "an admin key (flagged 'admin' in the keys file)"
    else:
        hint = "a key of the project 'default' (the --api-key), or flag a key 'admin' in the keys file"
    raise APIError(403, f"This key cannot use {request.url.path}, an operator's route: use {hint}.",
                   code="permission_denied")


def require_metrics_key(request: Request) -> None:
    """401/403 unless the request carries a key that may read /metrics (checked by the middleware first)."""
    refusal = authorize_metrics(request.headers.get("authorization", ""), get_keys(request))
    if refusal is not None:
        raise refusal


def request_project(request: Request) -> str:
    """The project the request acts for: its key's, found by RequestContextMiddleware before the body was read
    (checked here again only for an app run without it); 401 without a valid key."""
    project: str | None = request.scope.get("state", {}).get("project")
    if project is None:
        outcome = authenticate(request.headers.get("authorization", ""), get_keys(request))
        if isinstance(outcome, APIError):
            raise outcome
        project = outcome
    return project


def require_api_key(request: Request) -> None:
    """401 unless the request carries a valid `Authorization: Bearer <key>` when the gateway has keys. (The
    middleware checks it first, before any body is read; this keeps each router's requirement explicit.)"""
    request_project(request)


@dataclass(frozen=True)
class ServedModel:
    """What a request's `model` names: the served model, or one of its LoRA adapters."""

    id: str  # the name answers echo (vLLM's behaviour: an adapter's name)
    adapter: str = ""  # the engine's adapter name (GenerateRequest.adapter); "" for the base model


def served_model(pool: EnginePool, requested: str) -> ServedModel:
    """The model a generation request names: the served model id, or a LoRA adapter some engine serves; 404
    (model_not_found) for another name, 503 before any engine answered."""
    model_id = pool.model_id
    if model_id is None:
        raise pool.unavailable()
    if requested == model_id:
        return ServedModel(model_id)
    if pool.adapter(requested) is not None:
        return ServedModel(requested, requested)
    raise model_not_found(unknown_model_message(requested, model_id, [a.name for a in pool.adapters()]))


def served_or_default(pool: EnginePool, requested: str | None) -> ServedModel:
    """`served_model` for a body whose `model` is optional: absent, the served model; named (even ""), it must be
    served."""
    return served_model(pool, requested if requested is not None else pool.model_id or "")


def base_model(pool: EnginePool, requested: str) -> str:
    """The served model id for a pooling request (embeddings, score, rerank); a LoRA adapter's name is a 400:
    adapters change generation only."""
    served = served_model(pool, requested)
    if served.adapter:
        raise APIError(400, f"`{requested}` is a LoRA adapter, which serves generation only (chat, completions, "
                       f"responses); use the model `{pool.model_id}` here", param="model", code="unsupported_by_model")
    return served.id


class RequestTimer:
    """Latency and token metrics of one generation or pooling request on one route, and its usage, counted for
    `project` and `model` (`UsageLedger`)."""

    def __init__(self, metrics: GatewayMetrics, route: str, project: str, model: str,
                 admission: Admission | None = None) -> None:
        self.metrics = metrics
        self.route = route
        self.project = project
        self.model = model
        self.admission = admission  # the request's rate-limit reservation, corrected when it finishes
        self.started = time.monotonic()
        self._last: float | None = None

    def token(self) -> None:
        """A chunk with new output was sent: the first gives TTFT, later ones inter-token latency."""
        now = time.monotonic()
        if self._last is None:
            self.metrics.ttft.labels(self.route).observe(now - self.started)
        else:
            self.metrics.itl.labels(self.route).observe(now - self._last)
        self._last = now

    def finish(self, usage: Iterable[types_pb2.Usage]) -> None:
        """The request ended; `usage` holds one entry per engine request it made."""
        usage = list(usage)
        self.metrics.e2e.labels(self.route).observe(time.monotonic() - self.started)
        for u in usage:
            self.metrics.prompt_tokens.labels(self.route).inc(u.prompt_tokens)
            self.metrics.completion_tokens.labels(self.route).inc(u.completion_tokens)
        self.metrics.usage.record(self.project, self.model, "interactive", usage)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({
                "gen_ai.request.model": self.model, "gen_ai.usage.input_tokens": sum(u.prompt_tokens for u in usage),
                "gen_ai.usage.output_tokens": sum(u.completion_tokens for u in usage),
                "ladle.usage.cached_tokens": sum(u.cached_prompt_tokens for u in usage),
            })
        if self.admission is not None:
            self.admission.settle(sum(u.prompt_tokens + u.completion_tokens for u in usage))


# Annotated forms for route signatures (FastAPI's recommended style).
Pool = Annotated[EnginePool, Depends(get_pool)]
Metrics = Annotated[GatewayMetrics, Depends(get_metrics)]
RequestId = Annotated[str, Depends(request_id)]
CallId = Annotated[str, Depends(call_id)]
Batches = Annotated[BatchService, Depends(get_batches)]
Responses = Annotated[ResponseService, Depends(get_responses)]
Adapters = Annotated[AdapterRegistry, Depends(get_adapters)]
Config = Annotated[GatewayConfig, Depends(get_config)]
Project = Annotated[str, Depends(request_project)]
IsAdmin = Annotated[bool, Depends(request_is_admin)]
Limiter = Annotated[RateLimiter, Depends(get_limiter)]
Media = Annotated[MediaFetcher, Depends(get_media)]
HttpRequest = Request  # a route's own HTTP request (named apart from the engine request routes build)
