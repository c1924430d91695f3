"""A Batch call ended by the engine while the client is still sending reports the engine's status (grpc/grpc#36066:
grpc.aio alone reports most such calls as INTERNAL "Internal error from Core"). Real grpc.aio servers on loopback,
the real clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from ladle.client import AsyncEngineClient, EngineClient
from ladle.kept_status import WRITE_FAILURE_DETAILS, KeptStatusCall
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

ROUNDS = 60  # with grpc.aio alone, ~85% of these calls end INTERNAL on loopback


def item(item_id: str = "a") -> engine_pb2.BatchRequest:
    request = engine_pb2.GenerateRequest(input=types_pb2.Input(text="hello " * 200))
    return engine_pb2.BatchRequest(item_id=item_id, request=request)


class EndingEngine(engine_pb2_grpc.EngineServiceServicer):
    """Its Batch reads `answered` items, answers each, then ends the call with `code` without reading on."""

    def __init__(self, code: grpc.StatusCode, answered: int = 0) -> None:
        self.code = code
        self.answered = answered

    async def Batch(self, requests: Any, context: Any) -> AsyncIterator[engine_pb2.BatchResponse]:
        for _ in range(self.answered):
            request = await anext(aiter(requests))
            yield engine_pb2.BatchResponse(item_id=request.item_id)
        if self.code is not grpc.StatusCode.OK:
            await context.abort(self.code, f"ended {self.code.name}")


async def serve(engine: EndingEngine) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def endless() -> AsyncIterator[engine_pb2.BatchRequest]:
    """Items as fast as the call takes them, never the end: a write is always under way."""
    count = 0
    while True:
        count += 1
        yield item(str(count))


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE])
async def test_a_batch_refused_at_its_start_reports_the_engines_status(code: grpc.StatusCode) -> None:
    server, address = await serve(EndingEngine(code))
    try:
        async with AsyncEngineClient(address, timeout=10, retries=False) as client:
            for _ in range(ROUNDS):
                call = client.batch(iter([item(str(i)) for i in range(8)]))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in call:
                        pass
                assert (caught.value.code(), caught.value.details()) == (code, f"ended {code.name}")
                assert (await call.code(), await call.details()) == (code, f"ended {code.name}")
    finally:
        await server.stop(0)


async def test_a_batch_ended_midway_reports_the_engines_status_and_keeps_the_answers_before_it() -> None:
    """The draining engine's case: some items answered, then UNAVAILABLE while the client still sends more."""
    server, address = await serve(EndingEngine(grpc.StatusCode.UNAVAILABLE, answered=2))
    try:
        async with AsyncEngineClient(address, timeout=10, retries=False) as client:
            for _ in range(ROUNDS // 4):
                call = client.batch(endless())
                answered = []
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for response in call:
                        answered.append(response.item_id)
                assert answered == ["1", "2"]
                assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_a_batch_the_engine_ends_well_early_is_no_error() -> None:
    server, address = await serve(EndingEngine(grpc.StatusCode.OK, answered=1))
    try:
        async with AsyncEngineClient(address, timeout=10) as client:
            for _ in range(ROUNDS // 4):
                call = client.batch(endless())
                assert [response.item_id async for response in call] == ["1"]
                assert await call.code() is grpc.StatusCode.OK
    finally:
        await server.stop(0)


async def test_writes_and_reads_of_a_refused_call_report_the_engines_status() -> None:
    server, address = await serve(EndingEngine(grpc.StatusCode.UNAUTHENTICATED))
    codes: list[grpc.StatusCode] = []
    try:
        async with AsyncEngineClient(address, timeout=10) as client:
            for _ in range(ROUNDS // 2):
                call = KeptStatusCall(client.stub.Batch())
                try:
                    for count in range(1000):
                        await call.write(item(str(count)))
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
                except asyncio.InvalidStateError:  # grpc's answer to a write once the call is known to be over
                    pass
                with pytest.raises(grpc.aio.AioRpcError) as read:
                    await call.read()
                codes.append(read.value.code())
    finally:
        await server.stop(0)
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}


class SyncRefusingEngine(engine_pb2_grpc.EngineServiceServicer):
    def Batch(self, requests: Any, context: Any) -> Iterator[engine_pb2.BatchResponse]:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "refused")
        yield engine_pb2.BatchResponse()


def test_the_blocking_client_reports_the_engines_status_too() -> None:
    """grpc's blocking API has no such race; checked so that the two clients agree."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineServiceServicer_to_server(SyncRefusingEngine(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with EngineClient(f"127.0.0.1:{port}", timeout=10) as client:
            for _ in range(ROUNDS // 4):
                with pytest.raises(grpc.RpcError) as caught:
                    list(client.batch(item(str(i)) for i in range(8)))
                assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    finally:
        server.stop(0)


class FinishedCall:
    """Stands for a finished grpc.aio call: its status getters complete without waiting, as grpc's do."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        self.callbacks: list[Any] = []

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return self._details

    async def trailing_metadata(self) -> None:
        return None


def test_grpcs_own_write_failure_is_never_kept() -> None:
    """When the failed write is the first status the call gets, the server's may still come: grpc's answer
    stands."""
    for code, details, kept in [
        (grpc.StatusCode.INTERNAL, WRITE_FAILURE_DETAILS, False),
        (grpc.StatusCode.INTERNAL, "the engine failed", True),
        (grpc.StatusCode.UNAVAILABLE, WRITE_FAILURE_DETAILS, True),
    ]:
        call = FinishedCall(code, details)
        wrapped = KeptStatusCall(call)  # type: ignore[arg-type]
        call.callbacks[0](call)
        assert (wrapped._kept is not None) is kept
