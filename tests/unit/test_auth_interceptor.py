"""The engine port's bearer token: the interceptor on a real loopback grpc.aio server (a tiny EngineService, no
model), the token file, the client that sends it and the gateway's engine pool facing an engine that refuses it."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from engine_server.server.auth import MISSING_MESSAGE, WRONG_MESSAGE, BearerTokenInterceptor
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.errors import APIError, from_status
from ladle.auth import AuthTokenError, bearer_metadata, read_token_file, sender_token
from ladle.client import SERVICE, AsyncEngineClient
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from ladle_cli.engine_child import engine_command, engine_token_file
from ladle_cli.main import _gateway_config, build_parser, main

TOKENS = ("first-token-0123456789", "second-token-9876543210")


class TinyEngine(engine_pb2_grpc.EngineServiceServicer):
    """Answers the RPCs the tests call and counts every call that reached it."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: Any, context: Any) -> engine_pb2.GenerateResponse:
        self.calls += 1
        return engine_pb2.GenerateResponse(choices=[types_pb2.Choice(text="ok")])

    async def Stream(self, request: Any, context: Any) -> AsyncIterator[engine_pb2.StreamResponse]:
        self.calls += 1
        yield engine_pb2.StreamResponse()

    async def Batch(self, requests: Any, context: Any) -> AsyncIterator[engine_pb2.BatchResponse]:
        self.calls += 1
        async for item in requests:
            yield engine_pb2.BatchResponse(item_id=item.item_id)

    async def GetModelInfo(self, request: Any, context: Any) -> engine_pb2.GetModelInfoResponse:
        self.calls += 1
        return engine_pb2.GetModelInfoResponse(model_id="tiny", max_num_seqs=2)

    async def GetLoad(self, request: Any, context: Any) -> engine_pb2.GetLoadResponse:
        self.calls += 1
        return engine_pb2.GetLoadResponse()


async def start_server(tokens: tuple[str, ...] = TOKENS) -> tuple[grpc.aio.Server, TinyEngine, str]:
    """What EngineServer assembles: the service, health (SERVING), reflection, and the interceptor."""
    engine = TinyEngine()
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(tokens)] if tokens else None)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, engine, f"127.0.0.1:{port}"


@pytest.fixture
async def served() -> AsyncIterator[tuple[TinyEngine, str]]:
    server, engine, address = await start_server()
    yield engine, address
    await server.stop(0)


def generate_request() -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(input=types_pb2.Input(text="hi"))


async def every_rpc(client: AsyncEngineClient) -> None:
    """Generate, Stream, Batch and GetModelInfo, each read to its end."""
    await client.generate(generate_request())
    async for _ in client.stream(engine_pb2.StreamRequest(input=types_pb2.Input(text="hi"))):
        pass
    items = [engine_pb2.BatchRequest(item_id="a", request=generate_request())]
    assert [reply.item_id async for reply in client.batch(iter(items))] == ["a"]
    assert (await client.model_info()).model_id == "tiny"


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


@pytest.mark.parametrize("token", [None, "wrong-token", TOKENS[0][:-1], TOKENS[0] + "x"])
async def test_every_rpc_without_the_token_is_refused_and_never_runs(
    served: tuple[TinyEngine, str], token: str | None
) -> None:
    engine, address = served
    async with AsyncEngineClient(address, timeout=10, auth_token=token) as client:
        calls = [
            client.generate(generate_request()),
            client.model_info(),
            client.load(),
            _drain(client.stream(engine_pb2.StreamRequest(input=types_pb2.Input(text="hi")))),
            _drain(client.batch(iter([engine_pb2.BatchRequest(item_id="a", request=generate_request())]))),
        ]
        for call in calls:
            error = await refusal(call)
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED
            assert error.details() == (MISSING_MESSAGE if token is None else WRONG_MESSAGE)
    assert engine.calls == 0


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def test_a_batch_caller_is_refused_before_it_sends_anything(served: tuple[TinyEngine, str]) -> None:
    """A streaming caller gets a streaming refusal at once, whether it keeps sending or has nothing to send yet (a
    unary refusal would wait for a first item that never comes)."""
    _, address = served

    async def endless() -> AsyncIterator[engine_pb2.BatchRequest]:
        while True:
            yield engine_pb2.BatchRequest(item_id="a", request=generate_request())
            await asyncio.sleep(0.01)

    async def silent() -> AsyncIterator[engine_pb2.BatchRequest]:
        await asyncio.sleep(3600)
        yield engine_pb2.BatchRequest()

    async with AsyncEngineClient(address, timeout=10) as client:
        for feeder in (endless(), silent()):
            error = await refusal(asyncio.wait_for(_drain(client.batch(feeder)), 5))
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_health_needs_no_token(served: tuple[TinyEngine, str]) -> None:
    _, address = served
    async with AsyncEngineClient(address, timeout=10) as client:
        for service in ("", SERVICE):
            assert await client.health(service) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("token", TOKENS)
async def test_every_rpc_with_a_token_of_the_file_runs(served: tuple[TinyEngine, str], token: str) -> None:
    engine, address = served
    async with AsyncEngineClient(address, timeout=10, auth_token=token) as client:
        await every_rpc(client)
        assert await client.health() == health_pb2.HealthCheckResponse.SERVING
    assert engine.calls == 4


async def test_the_scheme_is_case_insensitive_and_spaces_around_are_ignored(served: tuple[TinyEngine, str]) -> None:
    _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for value in (f"bearer {TOKENS[0]}", f"BEARER   {TOKENS[1]}  ", f"Bearer {TOKENS[0]}"):
            reply = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), metadata=(("authorization", value),))
            assert reply.model_id == "tiny"
        for value in (TOKENS[0], f"Basic {TOKENS[0]}", "Bearer", "Bearer "):
            error = await refusal(stub.GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                    metadata=(("authorization", value),)))
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_reflection_and_unknown_methods_need_the_token(served: tuple[TinyEngine, str]) -> None:
    _, address = served
    list_services = reflection_pb2.ServerReflectionRequest(list_services="")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        error = await refusal(_drain(stub.ServerReflectionInfo(iter([list_services]))))
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED
        replies = [r async for r in stub.ServerReflectionInfo(iter([list_services]),
                                                               metadata=bearer_metadata(TOKENS[1]))]
        assert SERVICE in {s.name for s in replies[0].list_services_response.service}
        # An unknown method answers UNAUTHENTICATED too: a caller without the token learns nothing of the API.
        unknown = channel.unary_unary("/ladle.v1.EngineService/NoSuchMethod", request_serializer=bytes,
                                      response_deserializer=bytes)
        error = await refusal(unknown(b""))
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED
        error = await refusal(unknown(b"", metadata=bearer_metadata(TOKENS[0])))
        assert error.code() is grpc.StatusCode.UNIMPLEMENTED


def test_the_interceptor_needs_a_token() -> None:
    for tokens in ((), ("",)):
        with pytest.raises(ValueError, match="non-empty token"):
            BearerTokenInterceptor(tokens)


def test_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"\n  {TOKENS[0]}  \n\n{TOKENS[1]}\r\n")
    assert read_token_file(path) == TOKENS
    assert sender_token(path) == TOKENS[0]
    for text, fragment in (("", "is empty"), (" \n\t\n", "is empty"), ("two words\n", "token 1"),
                           ("ok\ntokén\n", "token 2")):
        path.write_text(text)
        with pytest.raises(AuthTokenError, match=fragment):
            read_token_file(path)
    with pytest.raises(AuthTokenError, match="cannot read"):
        read_token_file(tmp_path / "missing")
    assert bearer_metadata(None) == () and bearer_metadata("t") == (("authorization", "Bearer t"),)


async def pool_state(address: str, token: str | None) -> tuple[bool, str | None, APIError | None]:
    """(serving, refused, the error a request gets) after one poll of an EnginePool sending `token`."""
    pool = EnginePool(GatewayConfig(engines=(address,), health_interval_s=0.05, engine_auth_token=token))
    await pool.start()
    try:
        await pool.wait_ready(0.5)
        (engine,) = pool.engines
        try:
            pool.pick()
            error = None
        except APIError as exc:
            error = exc
        return engine.serving, engine.refused, error
    finally:
        await pool.close()


async def test_the_gateway_pool_never_routes_to_an_engine_that_refuses_its_token(
    served: tuple[TinyEngine, str],
) -> None:
    """Health (no token needed) says SERVING, but every call would be refused: the engine is not serving for this
    gateway, and a request gets 503 naming the refusal at once instead of the engine's UNAUTHENTICATED."""
    _, address = served
    assert await pool_state(address, TOKENS[0]) == (True, None, None)
    for token in (None, "wrong-token"):
        serving, refused, error = await pool_state(address, token)
        assert not serving and refused in (MISSING_MESSAGE, WRONG_MESSAGE)
        assert error is not None and error.status == 503 and error.code == "engine_unavailable"
        assert "refuses this gateway's calls (UNAUTHENTICATED" in error.message and address in error.message
        assert "--engine-auth-token-file" in error.message


def test_an_engine_call_refused_for_the_token_is_a_503_not_the_callers_401() -> None:
    error = from_status(grpc.StatusCode.UNAUTHENTICATED, WRONG_MESSAGE)
    assert (error.status, error.type, error.code) == (503, "service_unavailable_error", "engine_unavailable")
    assert WRONG_MESSAGE in error.message and "--engine-auth-token-file" in error.message


def test_engine_start_fails_clearly_on_a_bad_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, fragment in ((empty, "is empty"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(SystemExit) as exited:
            main(["engine", "--auth-token-file", str(path)])
        assert exited.value.code == 2
        assert "ladle engine: " in (err := capsys.readouterr().err) and fragment in err
    with pytest.raises(SystemExit) as exited:
        main(["gateway", "--engine-auth-token-file", str(empty)])
    assert exited.value.code == 2 and "is empty" in capsys.readouterr().err


def test_serve_and_batch_give_their_engine_a_private_random_token(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    with engine_token_file("") as path, engine_token_file("") as other:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(Path(path).parent).st_mode) == 0o700
        assert len(sender_token(path)) >= 40 and sender_token(path) != sender_token(other)
        for command in ("serve", "batch"):
            extra = ["-i", "a", "-o", "b"] if command == "batch" else []
            args = parser.parse_args([command, *extra])
            assert "--auth-token-file" not in engine_command(args, "127.0.0.1", 1)
            args.engine_auth_token_file = path
            child = engine_command(args, "127.0.0.1", 1)
            assert build_parser().parse_args(child[3:]).auth_token_file == path  # the child parses it
        args = parser.parse_args(["serve"])
        args.engine_auth_token_file = path
        config = _gateway_config(args, "127.0.0.1:1")
        assert config.engine_auth_token == sender_token(path) and config.engine_auth_token not in repr(config)
    assert not Path(path).parent.exists()
    with engine_token_file("/a/given/file") as given:
        assert given == "/a/given/file"
    monkeypatch.setenv("LADLE_AUTH_TOKEN_FILE", "/run/secrets/token")
    monkeypatch.setenv("LADLE_ENGINE_AUTH_TOKEN_FILE", "/run/secrets/engine-token")
    assert build_parser().parse_args(["engine"]).auth_token_file == "/run/secrets/token"
    for words in (["gateway"], ["serve"], ["batch", "-i", "a", "-o", "b"]):
        assert build_parser().parse_args(words).engine_auth_token_file == "/run/secrets/engine-token"
