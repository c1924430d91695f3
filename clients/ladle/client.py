"""A thin typed client for a ladle engine: `EngineClient` (blocking) and `AsyncEngineClient` (asyncio).

Both take and return the generated ladle.v1 messages unchanged and add what every caller needs: a deadline on
every call (`timeout`, seconds; None for none), keepalive pings that hold an idle channel open, message limits
that fit the longest context, reconnection within about a second of an engine's return, and a service config
that retries UNAVAILABLE (engine loading, draining or restarting) with backoff. gRPC retries a call only until
the server has started to respond, so a retried Stream or Batch never repeats output the caller has already seen.

    with EngineClient("127.0.0.1:50051") as client:
        client.wait_until_serving(timeout=120)
        reply = client.generate(engine_pb2.GenerateRequest(input=types_pb2.Input(text="Hello")))
        vectors = client.embed(engine_pb2.EmbedRequest(inputs=[types_pb2.Input(text="Hello")]))

An engine started with `--auth-token-file` needs its token on every call: `EngineClient(target,
auth_token=ladle.auth.sender_token(path))` sends it (as `authorization: Bearer <token>` metadata; gRPC's own
call credentials would need a TLS channel). `AsyncEngineClient` also sends the current OpenTelemetry span's trace
context (`ladle.tracing`) with every call, so an engine with tracing on continues the caller's trace.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, TypeAlias, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.auth import bearer_metadata
from ladle.kept_status import KeptStatusCall
from ladle.tracing import context_metadata
from ladle.v1 import engine_pb2, engine_pb2_grpc

SERVICE = "ladle.v1.EngineService"
DEFAULT_TIMEOUT_S = 600.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # matches the engine's limit
KEEPALIVE_MS = 30_000  # the engine permits client pings every 20 s or more
# gRPC waits up to 120 s (growing 1.6x from 1 s) between attempts to reconnect to an address that refused it,
# and a call in between fails at once: a restarted engine stayed unseen by the gateway's 1 s health polls for
# 9 to 20 s in the e2e tests. An engine that comes back is tried again within about a second.
MAX_RECONNECT_BACKOFF_MS = 1_000

# Retries apply before the server responds (gRPC never retries a committed call), so they are safe for
# every method, including the streams.
SERVICE_CONFIG: dict[str, Any] = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.2s",
                "maxBackoff": "5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


def channel_options(
    service_config: dict[str, Any] | None = None, retries: bool = True, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> list[tuple[str, Any]]:
    """Options for a channel to an engine; pass them when building your own channel too. Without `retries`, a
    call that finds the engine UNAVAILABLE fails at once (a caller with other engines goes to one of them).
    `max_message_bytes` bounds each message either way (a larger reply fails its call RESOURCE_EXHAUSTED)."""
    return [
        ("grpc.enable_retries", int(retries)),
        ("grpc.service_config", json.dumps(service_config or SERVICE_CONFIG)),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


ServingStatus: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType
Timeout = float | None | Literal["default"]  # seconds; None: no deadline; "default": the client's own
StreamCall: TypeAlias = "grpc.aio.UnaryStreamCall[engine_pb2.StreamRequest, engine_pb2.StreamResponse]"
BatchCall: TypeAlias = "grpc.aio.StreamStreamCall[engine_pb2.BatchRequest, engine_pb2.BatchResponse]"


class EngineClient:
    """Blocking client. Streams are returned as the gRPC call: iterate it, or `.cancel()` it to abort.
    `auth_token`: sent on every call as `authorization: Bearer <token>` (an engine started with
    --auth-token-file refuses calls without it; see ladle.auth)."""

    def __init__(
        self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, auth_token: str | None = None
    ) -> None:
        self.channel = grpc.insecure_channel(target, options=channel_options())
        self._metadata = bearer_metadata(auth_token)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    def generate(
        self, request: engine_pb2.GenerateRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.GenerateResponse:
        return self.stub.Generate(request, timeout=self._pick(timeout), metadata=self._metadata)

    def stream(
        self, request: engine_pb2.StreamRequest, *, timeout: Timeout = "default"
    ) -> Iterator[engine_pb2.StreamResponse]:
        call = self.stub.Stream(request, timeout=self._pick(timeout), metadata=self._metadata)
        return cast(Iterator[engine_pb2.StreamResponse], call)

    def batch(
        self, items: Iterable[engine_pb2.BatchRequest], *, timeout: Timeout = "default"
    ) -> Iterator[engine_pb2.BatchResponse]:
        call = self.stub.Batch(iter(items), timeout=self._pick(timeout), metadata=self._metadata)
        return cast(Iterator[engine_pb2.BatchResponse], call)

    def embed(self, request: engine_pb2.EmbedRequest, *, timeout: Timeout = "default") -> engine_pb2.EmbedResponse:
        """One vector per input of `request`, in order."""
        return self.stub.Embed(request, timeout=self._pick(timeout), metadata=self._metadata)

    def score(self, request: engine_pb2.ScoreRequest, *, timeout: Timeout = "default") -> engine_pb2.ScoreResponse:
        """One score per document of `request`, in order."""
        return self.stub.Score(request, timeout=self._pick(timeout), metadata=self._metadata)

    def tokenize(
        self, request: engine_pb2.TokenizeRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.TokenizeResponse:
        return self.stub.Tokenize(request, timeout=self._pick(timeout), metadata=self._metadata)

    def detokenize(
        self, request: engine_pb2.DetokenizeRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.DetokenizeResponse:
        return self.stub.Detokenize(request, timeout=self._pick(timeout), metadata=self._metadata)

    def model_info(self, *, timeout: Timeout = "default") -> engine_pb2.GetModelInfoResponse:
        request = engine_pb2.GetModelInfoRequest()
        return self.stub.GetModelInfo(request, timeout=self._pick(timeout), metadata=self._metadata)

    def load(self, *, timeout: Timeout = "default") -> engine_pb2.GetLoadResponse:
        request = engine_pb2.GetLoadRequest()
        return self.stub.GetLoad(request, timeout=self._pick(timeout), metadata=self._metadata)

    def load_adapter(self, name: str, path: str, *, timeout: Timeout = "default") -> engine_pb2.LoadAdapterResponse:
        """Serve the LoRA adapter in folder `path` (on the engine's host) as `name`."""
        request = engine_pb2.LoadAdapterRequest(name=name, path=path)
        return self.stub.LoadAdapter(request, timeout=self._pick(timeout), metadata=self._metadata)

    def unload_adapter(self, name: str, *, timeout: Timeout = "default") -> engine_pb2.UnloadAdapterResponse:
        request = engine_pb2.UnloadAdapterRequest(name=name)
        return self.stub.UnloadAdapter(request, timeout=self._pick(timeout), metadata=self._metadata)

    def health(self, service: str = SERVICE, *, timeout: float = 5.0) -> ServingStatus:
        """The engine's grpc.health.v1 status for `service` ("" for the server as a whole)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return self._health.Check(request, timeout=timeout, metadata=self._metadata).status

    def wait_until_serving(self, timeout: float = 300.0) -> None:
        """Block until health is SERVING (the model is loaded and warm); TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=min(5.0, timeout)) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not SERVING within {timeout} s")
            time.sleep(0.2)

    def _pick(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout == "default" else timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineClient:
    """asyncio client. Streams are returned as the gRPC call: iterate it with `async for`, or `.cancel()` it (or
    the consuming task) to abort. `retries=False` turns off the service config's retries of UNAVAILABLE and
    `max_message_bytes` bounds a message (see `channel_options`); `auth_token` is sent on every call, as by
    `EngineClient`."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        retries: bool = True,
        auth_token: str | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.channel = grpc.aio.insecure_channel(
            target, options=channel_options(retries=retries, max_message_bytes=max_message_bytes))
        self._metadata = bearer_metadata(auth_token)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    async def generate(
        self, request: engine_pb2.GenerateRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.GenerateResponse:
        return await self.stub.Generate(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    def stream(self, request: engine_pb2.StreamRequest, *, timeout: Timeout = "default") -> StreamCall:
        return self.stub.Stream(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    def batch(
        self,
        items: AsyncIterator[engine_pb2.BatchRequest] | Iterator[engine_pb2.BatchRequest],
        *,
        timeout: Timeout = "default",
        metadata: Sequence[tuple[str, str]] = (),
    ) -> BatchCall:
        """Items may come from a (async) generator, so an unbounded batch is fed as the engine asks for more;
        cancelling the call aborts every item still running. `metadata` is sent with the call's own. The call's
        error and status are those the engine ended it with, even while items were still being sent
        (`KeptStatusCall`)."""
        call = self.stub.Batch(items, timeout=self._pick(timeout), metadata=(*self._call_metadata(), *metadata))
        return KeptStatusCall(call)

    async def embed(
        self, request: engine_pb2.EmbedRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.EmbedResponse:
        """One vector per input of `request`, in order."""
        return await self.stub.Embed(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    async def score(
        self, request: engine_pb2.ScoreRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.ScoreResponse:
        """One score per document of `request`, in order."""
        return await self.stub.Score(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    async def tokenize(
        self, request: engine_pb2.TokenizeRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.TokenizeResponse:
        return await self.stub.Tokenize(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    async def detokenize(
        self, request: engine_pb2.DetokenizeRequest, *, timeout: Timeout = "default"
    ) -> engine_pb2.DetokenizeResponse:
        return await self.stub.Detokenize(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    async def model_info(self, *, timeout: Timeout = "default") -> engine_pb2.GetModelInfoResponse:
        request = engine_pb2.GetModelInfoRequest()
        return await self.stub.GetModelInfo(request, timeout=self._pick(timeout), metadata=self._metadata)

    async def load(self, *, timeout: Timeout = "default") -> engine_pb2.GetLoadResponse:
        request = engine_pb2.GetLoadRequest()
        return await self.stub.GetLoad(request, timeout=self._pick(timeout), metadata=self._metadata)

    async def load_adapter(
        self, name: str, path: str, *, timeout: Timeout = "default"
    ) -> engine_pb2.LoadAdapterResponse:
        """Serve the LoRA adapter in folder `path` (on the engine's host) as `name`."""
        request = engine_pb2.LoadAdapterRequest(name=name, path=path)
        return await self.stub.LoadAdapter(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    async def unload_adapter(self, name: str, *, timeout: Timeout = "default") -> engine_pb2.UnloadAdapterResponse:
        request = engine_pb2.UnloadAdapterRequest(name=name)
        return await self.stub.UnloadAdapter(request, timeout=self._pick(timeout), metadata=self._call_metadata())

    async def health(
        self, service: str = SERVICE, *, timeout: float = 5.0
    ) -> ServingStatus:
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self._health.Check(request, timeout=timeout, metadata=self._metadata)
        return cast(health_pb2.HealthCheckResponse, response).status

    async def wait_until_serving(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self.health(timeout=min(5.0, timeout)) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not SERVING within {timeout} s")
            await asyncio.sleep(0.2)

    def _pick(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout == "default" else timeout

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The token, and the current span's trace context (ladle.tracing) so the engine's spans continue it."""
        return (*self._metadata, *context_metadata())

    async def close(self) -> None:
        await self.channel.close(grace=None)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
