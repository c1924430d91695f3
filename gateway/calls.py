"""Engine calls as the routers need them: one engine picked per call, gRPC failures turned into `APIError`,
streams cancelled (so the engine aborts the request) whenever the consumer stops early.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TypeVar

import grpc

from gateway.engines import Engine, EnginePool
from gateway.errors import APIError, from_rpc_error, from_status, grpc_status
from ladle.v1 import engine_pb2

T = TypeVar("T")


@contextlib.contextmanager
def _on_engine(pool: EnginePool) -> Iterator[Engine]:
    """An engine for one call, counted as busy while the block runs; its gRPC failure becomes an APIError."""
    engine = pool.pick()
    engine.calls += 1
    try:
        yield engine
    except grpc.RpcError as error:
        if isinstance(error, grpc.aio.AioRpcError) and error.code() is grpc.StatusCode.UNAVAILABLE:
            pool.mark_down(engine)
        raise from_rpc_error(error, pool.config.retry_after_s) from error
    finally:
        engine.calls -= 1


async def generate(pool: EnginePool, request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateResponse:
    with _on_engine(pool) as engine:
        return await engine.client.generate(request)


async def generate_all(
    pool: EnginePool, requests: Sequence[engine_pb2.GenerateRequest]
) -> list[engine_pb2.GenerateResponse]:
    """Several independent requests at once (each on its own engine); the first failure cancels the rest.

    At most twice the engine's max_num_seqs are in flight (more would only wait in its queue), so a long prompt
    list never becomes a burst of calls that the engine's gRPC server sheds (CANCELLED).
    """
    info = pool.model_info()
    window = asyncio.Semaphore(2 * info.max_num_seqs if info is not None and info.max_num_seqs else 64)

    async def one(request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateResponse:
        async with window:
            return await generate(pool, request)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(r)) for r in requests]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


async def stream(pool: EnginePool, request: engine_pb2.GenerateRequest) -> AsyncIterator[engine_pb2.StreamResponse]:
    """The engine's stream for `request`. Closing the generator (or cancelling its consumer) cancels the call."""
    with _on_engine(pool) as engine:
        call = engine.client.stub.Stream(
            engine_pb2.StreamRequest(
                request_id=request.request_id, input=request.input, sampling=request.sampling,
                constraint=request.constraint if request.HasField("constraint") else None,
                priority=request.priority,
            ),
            timeout=pool.config.request_timeout_s,
        )
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()


async def batch(
    pool: EnginePool, requests: Sequence[engine_pb2.GenerateRequest], param: str
) -> list[engine_pb2.GenerateResponse]:
    """All `requests` through one Batch call, results in input order. The first failed item ends the call and is
    reported as `{param}[i]` (its own field, e.g. max_tokens, when the engine names one)."""
    items = [engine_pb2.BatchRequest(item_id=str(i), request=r) for i, r in enumerate(requests)]
    results: list[engine_pb2.GenerateResponse | None] = [None] * len(items)
    with _on_engine(pool) as engine:
        call = engine.client.stub.Batch(iter(items), timeout=pool.config.request_timeout_s)
        try:
            async for response in call:
                index = int(response.item_id)
                if response.WhichOneof("outcome") == "error":
                    error = response.error
                    failed = from_status(grpc_status(error.code),
                                         f"{param}[{index}]: {error.message}",
                                         error.param or f"{param}[{index}]", pool.config.retry_after_s)
                    raise failed
                results[index] = response.result
        finally:
            call.cancel()
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise APIError(500, f"the engine returned no result for {param}{missing[:5]}", type="server_error")
    return [r for r in results if r is not None]


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they arrive, tagged with the stream's position. The first failure ends the
    merge (and every stream); closing the merge closes every stream."""
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await queue.put((index, item))
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        for source in streams:
            await _close(source)


async def started(source: AsyncIterator[T]) -> AsyncIterator[T]:
    """`source` with its first item already received, so a failure before any output (a bad request, no engine)
    is raised here, while an HTTP error status can still be sent. Closing the result closes `source`."""
    try:
        first = await anext(source)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await _close(source)
        raise

    async def rest() -> AsyncIterator[T]:
        try:
            if first is not None:
                yield first
                async for item in source:
                    yield item
        finally:
            await _close(source)

    return rest()


async def _close(source: AsyncIterator[T]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def started_all(sources: Sequence[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """`started` for several sources at once; if any fails, every one is closed and the first failure raised."""
    results = await asyncio.gather(*(started(s) for s in sources), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for r in results:
            if not isinstance(r, BaseException):
                await _close(r)
        raise failures[0]
    return [r for r in results if not isinstance(r, BaseException)]
