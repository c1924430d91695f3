"""The engine-call pieces of gateway/calls.py that the routes and the line runner share: an engine held for a
call, the in-flight window and a Batch item's error. (Failover against fake engines: test_routing.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from gateway import calls
from gateway.config import GatewayConfig
from gateway.engines import Engine, EnginePool
from gateway.errors import item_error
from ladle.client import AsyncEngineClient
from ladle.v1 import engine_pb2


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom", None)


@pytest.fixture
async def pool_and_engine() -> AsyncIterator[tuple[EnginePool, Engine]]:
    """A pool with one SERVING engine that is never called (nothing listens on its address)."""
    pool = EnginePool(GatewayConfig(engines=("127.0.0.1:1",)))
    engine = Engine("127.0.0.1:1", AsyncEngineClient("127.0.0.1:1"), serving=True)
    pool.engines.append(engine)
    yield pool, engine
    await engine.client.close()


async def test_holding_counts_the_call_and_names_the_engine(pool_and_engine: tuple[EnginePool, Engine]) -> None:
    pool, engine = pool_and_engine
    engines: list[str] = []
    token = calls.served_by.set(engines)
    try:
        with calls.holding(pool, engine):
            assert engine.calls == 1
    finally:
        calls.served_by.reset(token)
    assert engine.calls == 0 and engines == [engine.address] and engine.serving


@pytest.mark.parametrize(("code", "down"), [(grpc.StatusCode.UNAVAILABLE, True),
                                            (grpc.StatusCode.INVALID_ARGUMENT, False)])
async def test_holding_marks_the_engine_down_only_when_it_is_unavailable(
    pool_and_engine: tuple[EnginePool, Engine], code: grpc.StatusCode, down: bool
) -> None:
    pool, engine = pool_and_engine
    error = rpc_error(code)
    with pytest.raises(grpc.aio.AioRpcError) as raised, calls.holding(pool, engine):
        raise error
    assert raised.value is error  # passed through as it is: mapping it is the caller's choice
    assert engine.calls == 0 and engine.serving is not down


def test_the_window_is_twice_the_engines_seats_or_a_default() -> None:
    assert calls.in_flight_window(engine_pb2.GetModelInfoResponse(max_num_seqs=3)) == 6
    assert calls.in_flight_window(engine_pb2.GetModelInfoResponse()) == calls.DEFAULT_WINDOW
    assert calls.in_flight_window(None) == calls.DEFAULT_WINDOW


def test_an_item_error_names_its_item_unless_the_engine_names_a_field() -> None:
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    named = item_error(engine_pb2.ItemError(code=code, message="too long", param="max_tokens"), 1, "messages[2]")
    assert (named.status, named.message, named.param) == (400, "messages[2]: too long", "max_tokens")
    unnamed = item_error(engine_pb2.ItemError(code=code, message="too long"), 1, "messages[2]")
    assert unnamed.param == "messages[2]"
    bare = item_error(engine_pb2.ItemError(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full"), 7)
    assert (bare.status, bare.message, bare.param, bare.headers) == (429, "full", None, {"Retry-After": "7"})
