"""The engine port's bearer-token check: a grpc.aio server interceptor that refuses unauthenticated RPCs.

With `ladle engine --auth-token-file`, every RPC needs the metadata `authorization: Bearer <token>` with one of
the file's tokens (ladle.auth), except `grpc.health.v1.Health/*`: Kubernetes probes, Envoy's health checks and
load balancers ask for health without secrets, and health tells them nothing but SERVING or not. Everything else
is refused with UNAUTHENTICATED before any of it runs: EngineService and server reflection too. Reflection
would leak only the schema, which is public (proto/ladle/v1); it is checked anyway so that an engine with a
token answers nothing but health to a caller without one (not even which RPCs this version has), and it costs
grpcurl users nothing: `-H 'authorization: Bearer …'` is sent with reflection's calls as with the RPC's.

Tokens are compared with `hmac.compare_digest`, each configured token every time (no early exit), so the time a
refusal takes does not tell how much of a guess was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog

from ladle.auth import AUTHORIZATION_KEY, BEARER

log = structlog.get_logger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
MISSING_MESSAGE = (f"this engine requires the metadata '{AUTHORIZATION_KEY}: {BEARER} <token>' on every call but "
                   "grpc.health.v1 (its token is set with ladle engine --auth-token-file); none was sent")
WRONG_MESSAGE = f"the {BEARER} token in '{AUTHORIZATION_KEY}' is not one this engine accepts"

Handler = grpc.RpcMethodHandler
# Its handler is None for a method no service has (grpc then answers UNIMPLEMENTED), though the stubs say not.
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call outside EXEMPT_PREFIXES whose metadata lacks one of `tokens`."""

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens or not all(tokens):
            raise ValueError("BearerTokenInterceptor needs at least one non-empty token")
        self._tokens = tuple(token.encode() for token in tokens)

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        method: str = details.method
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(details)
        presented = _bearer_tokens(details.invocation_metadata)
        if any(self._accepts(token) for token in presented):
            return await continuation(details)
        message = WRONG_MESSAGE if presented else MISSING_MESSAGE
        log.info("call refused: not authenticated", method=method, token_sent=bool(presented))
        # The method's own handler is looked up (nothing of it runs) only to refuse in its shape: a streaming
        # caller must get a streaming answer, or it would wait on a half-read stream.
        return _refusal(await continuation(details), message)

    def _accepts(self, presented: bytes) -> bool:
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(presented, token)  # every token, no early exit
        return matched


def _bearer_tokens(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[bytes]:
    """The tokens of every `authorization: Bearer <token>` entry (the scheme's case does not matter)."""
    tokens = []
    for key, value in metadata or ():
        if key != AUTHORIZATION_KEY or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == BEARER.lower() and token.strip():
            tokens.append(token.strip().encode())
    return tokens


def _refusal(handler: Handler | None, message: str) -> Handler:
    """A handler of `handler`'s kind (unary for an unknown method) that ends the call UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
