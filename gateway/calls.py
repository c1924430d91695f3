"""The gateway's one way to call engines, for the HTTP routes and the batch jobs' line runner alike.

The pieces: `holding` keeps an engine busy for one call (counted in `Engine.calls`, which routing reads; named in
the request's `served_by`; marked down when the call fails UNAVAILABLE); `open_stream` and `open_batch_rpc` open
the engine's Stream and Batch RPCs, cancelled (so the engine aborts what still runs) when their block exits;
`in_flight_window` bounds how many requests are sent ahead of an engine; `errors.from_rpc_error` and
`errors.item_error` turn a failed call or Batch item into an `APIError`; `batch_item` and `item_reply` put any
engine request (a generation, or an Embed / Score request) into a Batch item and take its result out. On them,
the routes' calls: `generate`, `embed`, `score`, `tokenize` (and `run_all` of one of them over several requests),
`stream` and `batch_rpc`, each on an engine chosen per call (`EnginePool.pick`).

Failover: a call whose engine is unavailable (it died, or it is draining) before it produced anything — a
non-streaming call, or a stream before its first message — is sent once more to another SERVING engine, within
what is left of the call's deadline. A stream that fails after output has reached the client ends with an
error, which the stream's consumer turns into an explicit error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TypeAlias, TypeVar

import grpc
import structlog

from gateway.engines import Engine, EnginePool, unauthenticated
from gateway.errors import APIError, from_rpc_error, item_error
from ladle.client import BatchCall, StreamCall
from ladle.tracing import BATCH_ID_KEY
from ladle.v1 import engine_pb2, types_pb2

T = TypeVar("T")
R = TypeVar("R")
CallT = TypeVar("CallT", bound=grpc.aio.Call)
EngineRequest: TypeAlias = engine_pb2.GenerateRequest | engine_pb2.EmbedRequest | engine_pb2.ScoreRequest
EngineReply: TypeAlias = engine_pb2.GenerateResponse | engine_pb2.EmbedResponse | engine_pb2.ScoreResponse
log = structlog.get_logger(__name__)

MAX_ATTEMPTS = 2  # the engine chosen first, then one other
DEFAULT_WINDOW = 64  # requests in flight on an engine that has not said how many sequences it runs

# The engines an HTTP request's calls went to, in order: the middleware gives each request a list (shared by the
# tasks the request starts, which copy the context) and logs it when the request is finished.
served_by: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("served_by", default=None)
# The batch job whose lines a Batch call carries: named to the engine (`ladle.tracing.BATCH_ID_KEY`) for its spans.
batch_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("batch_id", default=None)


@contextlib.contextmanager
def holding(pool: EnginePool, engine: Engine) -> Iterator[Engine]:
    """`engine` busy with one call while the block runs: counted in `engine.calls`, recorded in `served_by`, and
    marked down in `pool` if the call fails UNAVAILABLE or the engine refuses our token (UNAUTHENTICATED). Every
    error passes through as it is."""
    if (engines := served_by.get()) is not None:
        engines.append(engine.address)
    engine.calls += 1
    try:
        yield engine
    except grpc.RpcError as error:
        refused = unauthenticated(error)
        if refused is not None or _code(error) is grpc.StatusCode.UNAVAILABLE:
            pool.mark_down(engine, refused)
        raise
    finally:
        engine.calls -= 1


def open_stream(
    engine: Engine, request: engine_pb2.StreamRequest, timeout: float | None
) -> contextlib.AbstractContextManager[StreamCall]:
    """The engine's Stream call for `request`, cancelled when the block exits."""
    return _cancelled_at_exit(engine.client.stream(request, timeout=timeout))


def open_batch_rpc(
    engine: Engine,
    items: AsyncIterator[engine_pb2.BatchRequest] | Iterator[engine_pb2.BatchRequest],
    timeout: float | None,
) -> contextlib.AbstractContextManager[BatchCall]:
    """The engine's Batch call over `items` (read as the engine asks for more), cancelled when the block exits:
    the engine then aborts every item still running. It names the batch job it runs for (`batch_id`), if any."""
    job = batch_id.get()
    metadata = ((BATCH_ID_KEY, job),) if job is not None else ()
    return _cancelled_at_exit(engine.client.batch(items, timeout=timeout, metadata=metadata))


@contextlib.contextmanager
def _cancelled_at_exit(call: CallT) -> Iterator[CallT]:
    try:
        yield call
    finally:
        call.cancel()


def in_flight_window(info: engine_pb2.GetModelInfoResponse | None) -> int:
    """How many requests to keep in flight on an engine: twice the sequences it runs at once, as far ahead as it
    reads (more would only wait in its queue or in buffers)."""
    return 2 * info.max_num_seqs if info is not None and info.max_num_seqs else DEFAULT_WINDOW


def _code(error: grpc.RpcError) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else None


class _Attempts:
    """The engines one call has tried, and its deadline (`request_timeout_s` from the first attempt)."""

    def __init__(
        self, pool: EnginePool, inputs: Sequence[types_pb2.Input], cache_salt: str, adapter: str = ""
    ) -> None:
        self.pool = pool
        self.inputs = inputs
        self.cache_salt = cache_salt  # the call's prefix-cache namespace, which routing hashes with its inputs
        self.adapter = adapter  # the call's LoRA adapter: only engines that hold it are tried, while any does
        self.tried: list[Engine] = []
        self.deadline = asyncio.get_running_loop().time() + pool.config.request_timeout_s

    def remaining(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    @contextlib.contextmanager
    def on_engine(self) -> Iterator[Engine]:
        """An engine for one attempt, counted as busy while the block runs. A gRPC failure becomes an APIError,
        except UNAVAILABLE while another attempt is allowed (`may_retry`): that one is re-raised as it is, for
        the caller to try again (or, for a stream that already produced output, to report)."""
        engine = self.pool.pick(self.inputs, avoid=self.tried, cache_salt=self.cache_salt, adapter=self.adapter)
        self.tried.append(engine)
        try:
            with holding(self.pool, engine):
                yield engine
        except grpc.RpcError as error:
            if _code(error) is grpc.StatusCode.UNAVAILABLE and self.may_retry():
                raise
            raise from_rpc_error(error, self.pool.config.retry_after_s) from error

    def may_retry(self) -> bool:
        others = self.pool.eligible(self.adapter, avoid=self.tried)
        return len(self.tried) < MAX_ATTEMPTS and bool(others) and self.remaining() > 0

    def retrying(self, error: grpc.RpcError) -> None:
        """Log and count a failover from the engine tried last."""
        left = self.tried[-1]
        self.pool.failovers[left.address] += 1
        log.warning("engine unavailable before any output; sending the call to another engine",
                    engine=left.address, error=error.details() if isinstance(error, grpc.aio.AioRpcError) else "")


async def _unary(
    pool: EnginePool,
    inputs: Sequence[types_pb2.Input],
    cache_salt: str,
    send: Callable[[Engine, float], Awaitable[T]],
    adapter: str = "",
) -> T:
    """`send(engine, timeout)` on an engine chosen for `inputs` (and the request's `cache_salt` and LoRA `adapter`),
    and once more on another if that one is unavailable (see the module)."""
    attempts = _Attempts(pool, inputs, cache_salt, adapter)
    while True:
        try:
            with attempts.on_engine() as engine:
                return await send(engine, attempts.remaining())
        except grpc.RpcError as error:  # only UNAVAILABLE with another attempt left gets here
            attempts.retrying(error)


async def generate(pool: EnginePool, request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateResponse:
    """One non-streaming generation."""
    return await _unary(pool, [request.input], request.cache_salt,
                        lambda engine, timeout: engine.client.generate(request, timeout=timeout), request.adapter)


async def embed(pool: EnginePool, request: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
    """One Embed call (routed by its first input, like a generation)."""
    return await _unary(pool, request.inputs[:1], request.cache_salt,
                        lambda engine, timeout: engine.client.embed(request, timeout=timeout))


async def score(pool: EnginePool, request: engine_pb2.ScoreRequest) -> engine_pb2.ScoreResponse:
    """One Score call (routed by its query, like a generation)."""
    return await _unary(pool, [request.query], request.cache_salt,
                        lambda engine, timeout: engine.client.score(request, timeout=timeout))


async def tokenize(pool: EnginePool, request: engine_pb2.TokenizeRequest) -> engine_pb2.TokenizeResponse:
    """One Tokenize call (routed by its input, like a generation of it)."""
    return await _unary(pool, [request.input], "",
                        lambda engine, timeout: engine.client.tokenize(request, timeout=timeout))


async def detokenize(pool: EnginePool, request: engine_pb2.DetokenizeRequest) -> engine_pb2.DetokenizeResponse:
    """One Detokenize call (routed as a generation of those token ids)."""
    ids = types_pb2.Input(token_ids=types_pb2.TokenIds(ids=request.token_ids))
    return await _unary(pool, [ids], "", lambda engine, timeout: engine.client.detokenize(request, timeout=timeout))


async def generate_all(
    pool: EnginePool, requests: Sequence[engine_pb2.GenerateRequest]
) -> list[engine_pb2.GenerateResponse]:
    """Several independent generations at once (`run_all`)."""
    return await run_all(pool, requests, generate)


async def run_all(
    pool: EnginePool, requests: Sequence[R], call: Callable[[EnginePool, R], Awaitable[T]]
) -> list[T]:
    """`call` for several independent requests at once (each on its own engine), results in request order; the
    first failure cancels the rest.

    At most `in_flight_window` are in flight, so a long prompt list never becomes a burst of calls that the
    engine's gRPC server sheds (CANCELLED).
    """
    window = asyncio.Semaphore(in_flight_window(pool.model_info()))

    async def one(request: R) -> T:
        async with window:
            return await call(pool, request)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(r)) for r in requests]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


async def stream(pool: EnginePool, request: engine_pb2.GenerateRequest) -> AsyncIterator[engine_pb2.StreamResponse]:
    """The engine's stream for `request`, sent to a second engine if the first is unavailable before its first
    message. Closing the generator (or cancelling its consumer) cancels the call."""
    attempts = _Attempts(pool, [request.input], request.cache_salt, request.adapter)
    stream_request = engine_pb2.StreamRequest(
        request_id=request.request_id, input=request.input, sampling=request.sampling,
        constraint=request.constraint if request.HasField("constraint") else None, priority=request.priority,
        cache_salt=request.cache_salt, adapter=request.adapter,
    )
    while True:
        produced = False
        try:
            with attempts.on_engine() as engine, open_stream(engine, stream_request, attempts.remaining()) as call:
                async for message in call:
                    produced = True
                    yield message
                return
        except grpc.RpcError as error:  # UNAVAILABLE with another attempt left
            if produced:
                raise from_rpc_error(error, pool.config.retry_after_s) from error
            attempts.retrying(error)


async def batch_rpc(
    pool: EnginePool, requests: Sequence[engine_pb2.GenerateRequest], param: str
) -> list[engine_pb2.GenerateResponse]:
    """The engine's Batch RPC as `/v1/chat/completions/batch` uses it: all `requests` through one call, results in
    input order (all of one LoRA adapter, the first's). The first failed item ends the call and is reported as
    `{param}[i]` (its own field, e.g. max_tokens, when the engine names one). Nothing reaches the caller before the
    whole call is done, so an unavailable engine's call is sent whole to a second one."""
    first = requests[0] if requests else engine_pb2.GenerateRequest()
    attempts = _Attempts(pool, [r.input for r in requests], first.cache_salt, first.adapter)
    while True:
        try:
            with attempts.on_engine() as engine:
                results = await _batch_rpc_on(engine, requests, param, attempts.remaining(),
                                              pool.config.retry_after_s)
                break
        except grpc.RpcError as error:  # UNAVAILABLE with another attempt left
            attempts.retrying(error)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise APIError(500, f"the engine returned no result for {param}{missing[:5]}", type="server_error")
    return [r for r in results if r is not None]


async def _batch_rpc_on(
    engine: Engine, requests: Sequence[engine_pb2.GenerateRequest], param: str, timeout: float, retry_after_s: int
) -> list[engine_pb2.GenerateResponse | None]:
    items = [engine_pb2.BatchRequest(item_id=str(i), request=r) for i, r in enumerate(requests)]
    results: list[engine_pb2.GenerateResponse | None] = [None] * len(items)
    with open_batch_rpc(engine, iter(items), timeout) as call:
        async for response in call:
            index = int(response.item_id)
            if response.WhichOneof("outcome") == "error":
                raise item_error(response.error, retry_after_s, f"{param}[{index}]")
            results[index] = response.result
    return results


def batch_item(item_id: str, request: EngineRequest) -> engine_pb2.BatchRequest:
    """A Batch item for any engine request: a generation in `request`, Embed and Score requests in `pooling`."""
    if isinstance(request, engine_pb2.EmbedRequest):
        return engine_pb2.BatchRequest(item_id=item_id, embed=request)
    if isinstance(request, engine_pb2.ScoreRequest):
        return engine_pb2.BatchRequest(item_id=item_id, score=request)
    return engine_pb2.BatchRequest(item_id=item_id, request=request)


def item_reply(response: engine_pb2.BatchResponse) -> EngineReply | None:
    """A Batch item's result, whichever kind it is; None when the item failed (its `error`)."""
    outcome = response.WhichOneof("outcome")
    if outcome == "result":
        return response.result
    if outcome == "embed_result":
        return response.embed_result
    if outcome == "score_result":
        return response.score_result
    return None


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
