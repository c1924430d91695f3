"""Run batch lines through an engine's Batch RPC until each has exactly one result.

Lines stream into one Batch call at a time with at most `window` engine items unanswered (the engine reads a
call about twice its `max_num_seqs` ahead, so more would only sit in buffers). Each line's result is handed to
`emit` as soon as all of its engine items have answered. When the call fails (the engine died, restarts or
drains), every line still in flight is sent again on the next SERVING engine, keeping the parts that already
answered; an item the engine refused for load (RESOURCE_EXHAUSTED, UNAVAILABLE) is sent again a moment later.
Any other item error is that line's result: an error line with the HTTP status the route would have answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from gateway.batches import lines
from gateway.batches.lines import InputLine
from gateway.engines import Engine, EnginePool
from gateway.errors import APIError, from_status, grpc_status
from gateway.store.ids import BATCH_REQUEST_PREFIX, new_id
from ladle.v1 import engine_pb2, types_pb2

log = structlog.get_logger(__name__)

RETRYABLE_ITEM_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
})
MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class LineResult:
    """The one result of a line: the record for the output file (`ok`) or the error file, and its usage."""

    line: InputLine
    record: dict[str, Any]
    ok: bool
    usage: tuple[types_pb2.Usage, ...] = ()


@dataclass
class _Line:
    """A line between its first send and its result."""

    line: InputLine
    line_id: str
    replies: list[engine_pb2.GenerateResponse | None]
    request_id: str = ""
    error: APIError | None = None
    outstanding: int = 0  # items of this line sent in the current call and not yet answered
    not_before: float = 0.0  # loop time before which it is not sent again (after a refusal for load)

    def missing(self) -> list[int]:
        return [k for k, reply in enumerate(self.replies) if reply is None]


@dataclass
class _Progress:
    emit: Callable[[LineResult], None]
    retry: deque[_Line] = field(default_factory=deque)
    source_done: bool = False
    source_error: BaseException | None = None
    in_flight: dict[int, _Line] = field(default_factory=dict)  # by line index


class LineRunner:
    """Runs lines on the engines of `pool`. `model` is the id written into response bodies."""

    def __init__(self, pool: EnginePool, model: str, window: int | None = None) -> None:
        self.pool = pool
        self.model = model
        self.window = window
        self.in_flight = 0  # engine items sent and not yet answered

    async def run(
        self, source: AsyncIterator[InputLine], emit: Callable[[LineResult], None], stop: asyncio.Event
    ) -> bool:
        """Run every line of `source` once, calling `emit` with each result as it is final. Returns True once
        every line has its result, False as soon as `stop` is set (lines then in flight are cancelled in the
        engine and have no result)."""
        progress = _Progress(emit)
        backoff = 0.2
        while not stop.is_set():
            if progress.source_done and not progress.retry and not progress.in_flight:
                return True
            engine = await self._serving_engine(stop)
            if engine is None:
                break
            failed = await self._call(engine, source, progress, stop)
            if progress.source_error is not None:
                raise progress.source_error
            for pending in progress.in_flight.values():
                progress.retry.append(pending)
            progress.in_flight.clear()
            if failed and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            elif not failed:
                backoff = 0.2
        return False

    async def _serving_engine(self, stop: asyncio.Event) -> Engine | None:
        while not stop.is_set():
            with contextlib.suppress(APIError):  # none SERVING after all
                return self.pool.pick()
            await self.pool.wait_ready(timeout=0.5)
        return None

    async def _call(
        self,
        engine: Engine,
        source: AsyncIterator[InputLine],
        progress: _Progress,
        stop: asyncio.Event,
    ) -> bool:
        """One Batch call on `engine`; True if it failed (its lines in flight are then to be sent again)."""
        window = asyncio.Semaphore(self.window or _default_window(engine))
        call = engine.client.stub.Batch(self._feed(source, progress, window, stop), timeout=None)
        watcher = asyncio.ensure_future(stop.wait())
        watcher.add_done_callback(lambda _: call.cancel())
        engine.calls += 1
        try:
            async for response in call:
                window.release()
                self.in_flight -= 1
                self._answer(response, progress)
            return False
        except asyncio.CancelledError:
            # grpc raises CancelledError from a call cancelled here; a cancelled task must still see it.
            if stop.is_set() and not _task_cancelled():
                return False
            raise
        except grpc.RpcError as error:
            if stop.is_set():
                return False
            code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
            if code is grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(engine)
            log.warning("batch call failed; sending its lines again", engine=engine.address,
                        code=getattr(code, "name", None), in_flight=len(progress.in_flight))
            return True
        finally:
            engine.calls -= 1
            self.in_flight = 0
            watcher.cancel()
            call.cancel()

    async def _feed(
        self, source: AsyncIterator[InputLine], progress: _Progress, window: asyncio.Semaphore, stop: asyncio.Event
    ) -> AsyncIterator[engine_pb2.BatchRequest]:
        """The call's items: lines to send again first, then new lines, each item once the window has room."""
        while not stop.is_set():
            pending = await self._next_line(source, progress)
            if pending is None:
                return
            pending.request_id = "req_" + secrets.token_hex(12)  # a fresh engine id for every attempt
            try:
                requests = lines.engine_requests(pending.line, pending.request_id)
            except APIError as exc:  # cannot happen for a validated line; a result all the same
                pending.error = exc
                progress.emit(self._result(pending))
                continue
            if not pending.replies:
                pending.replies = [None] * len(requests)
            pending.outstanding = 0
            progress.in_flight[pending.line.index] = pending
            for k in pending.missing():
                await window.acquire()
                pending.outstanding += 1
                self.in_flight += 1
                yield engine_pb2.BatchRequest(item_id=f"{pending.line.index}:{k}", request=requests[k])

    async def _next_line(self, source: AsyncIterator[InputLine], progress: _Progress) -> _Line | None:
        """A line to send again (once its pause is over), else the next new line; None when there is none."""
        loop = asyncio.get_running_loop()
        while progress.retry:
            pending = progress.retry.popleft()
            if pending.error is not None:  # an item failed for good before its call was lost
                progress.emit(self._result(pending))
                continue
            if pending.not_before > loop.time():
                await asyncio.sleep(pending.not_before - loop.time())
            return pending
        if progress.source_done:
            return None
        try:
            line = await anext(source)
        except StopAsyncIteration:
            progress.source_done = True
            return None
        except Exception as exc:  # reading the input failed: `run` raises it once this call is over
            progress.source_error = exc
            progress.source_done = True
            return None
        return _Line(line, new_id(BATCH_REQUEST_PREFIX), [])

    def _answer(self, response: engine_pb2.BatchResponse, progress: _Progress) -> None:
        index, _, part = response.item_id.partition(":")
        pending = progress.in_flight.get(int(index))
        if pending is None:
            return
        pending.outstanding -= 1
        if response.WhichOneof("outcome") == "result":
            pending.replies[int(part)] = response.result
        else:
            item = response.error
            code = grpc_status(item.code)
            if code in RETRYABLE_ITEM_CODES:
                pending.not_before = asyncio.get_running_loop().time() + self.pool.config.retry_after_s
            elif pending.error is None:
                param = item.param or None
                pending.error = from_status(code, item.message, param, self.pool.config.retry_after_s)
        if pending.outstanding > 0:
            return
        del progress.in_flight[pending.line.index]
        if pending.error is None and pending.missing():
            progress.retry.append(pending)  # refused for load: again, after a moment
        else:
            progress.emit(self._result(pending))

    def _result(self, pending: _Line) -> LineResult:
        line = pending.line
        if pending.error is not None:
            record = lines.output_record(pending.line_id, line.custom_id, pending.request_id, pending.error.status,
                                         pending.error.body())
            return LineResult(line, record, ok=False)
        replies = [r for r in pending.replies if r is not None]
        body = lines.response_body(line, replies, pending.request_id, self.model)
        record = lines.output_record(pending.line_id, line.custom_id, pending.request_id, 200, body)
        return LineResult(line, record, ok=True, usage=tuple(r.usage for r in replies))


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _default_window(engine: Engine) -> int:
    """As far ahead as the engine reads a Batch call: twice the sequences it runs at once."""
    seats = engine.info.max_num_seqs if engine.info is not None else 0
    return 2 * seats if seats else 64
