"""Run a batch job's lines through an engine's Batch RPC until each has exactly one result.

Lines stream into one Batch call at a time (`gateway.calls`: the engine held, and marked down if the call ends
UNAVAILABLE) with at most `window` engine items unanswered (by default `calls.in_flight_window`: the engine reads
a call about twice its `max_num_seqs` ahead, so more would only sit in buffers). Each line's result is handed to
`emit` as soon as all of its engine items have answered (generations, or Embed / Score requests for the pooling
endpoints). When the call fails (the engine died, restarts or drains), every line still in flight is sent again
on the next SERVING engine, keeping the parts that already answered; an item the engine refused for load
(RESOURCE_EXHAUSTED, UNAVAILABLE) or ended with finish reason ABORT (a draining or stopping engine aborts what it
still runs) is sent again a moment later. Any other item error is that line's result: an error line with the
HTTP status the route would have answered.

The invariant: every line is, at every moment, in exactly one of four places — unread (in `source`, or read
and not yet taken), in flight (`_Progress.in_flight`), to retry (`_Progress.retry`) or emitted. A line moves
between them only in code that does not await in between, and a call's feeder stops taking lines the moment
its call has ended, so no interleaving of a call's end with a feeder's pause can leave a line nowhere.
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

from gateway import calls
from gateway.batches import lines
from gateway.batches.lines import InputLine
from gateway.engines import Engine, EnginePool
from gateway.errors import APIError, grpc_status, item_error
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
    replies: list[calls.EngineReply | None]
    request_id: str = ""
    requests: list[calls.EngineRequest] = field(default_factory=list)  # this attempt's, one per item
    error: APIError | None = None
    outstanding: int = 0  # items of this line sent in the current call and not yet answered
    not_before: float = 0.0  # loop time before which it is not sent again (after a refusal for load)

    def missing(self) -> list[int]:
        return [k for k, reply in enumerate(self.replies) if reply is None]


_END = object()


class _Source:
    """The unread lines. A read is a future kept here until a feeder has the line in hand, so a feeder
    abandoned mid-read (its call ended) leaves the line for the next call's feeder instead of losing it."""

    def __init__(self, lines_in: AsyncIterator[InputLine]) -> None:
        self._lines = lines_in
        self._next: asyncio.Future[Any] | None = None
        self.done = False
        self.error: BaseException | None = None

    async def take(self, ended: asyncio.Event) -> InputLine | None:
        """The next line; None at the end of the input, after a read error (kept in `error`), or when the
        caller's call has `ended` meanwhile (the line read is then kept for the next caller)."""
        while not self.done:
            if self._next is None:
                self._next = asyncio.ensure_future(_read_one(self._lines))
            read = self._next
            try:
                item = await asyncio.shield(read)
            except Exception as exc:  # reading the input failed: `run` raises it once the current call is over
                if self._next is read:
                    self.error, self.done, self._next = exc, True, None
                return None
            if ended.is_set():
                return None
            if self._next is not read:  # an abandoned feeder's read, already taken by the current one
                continue
            self._next = None
            if item is _END:
                self.done = True
                return None
            line: InputLine = item
            return line
        return None

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()


async def _read_one(source: AsyncIterator[InputLine]) -> Any:
    try:
        return await anext(source)
    except StopAsyncIteration:
        return _END


@dataclass
class _Progress:
    emit: Callable[[LineResult], None]
    source: _Source
    retry: deque[_Line] = field(default_factory=deque)
    in_flight: dict[int, _Line] = field(default_factory=dict)  # by line index

    @property
    def finished(self) -> bool:
        return self.source.done and not self.retry and not self.in_flight


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
        progress = _Progress(emit, _Source(source))
        backoff = 0.2
        try:
            while not stop.is_set():
                if progress.finished:
                    if progress.source.error is not None:
                        raise progress.source.error
                    return True
                engine = await self._serving_engine(stop)
                if engine is None:
                    break
                failed = await self._call(engine, progress, stop)
                if progress.source.error is not None:
                    raise progress.source.error
                if failed and not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                elif not failed:
                    backoff = 0.2
            return False
        finally:
            progress.source.close()

    async def _serving_engine(self, stop: asyncio.Event) -> Engine | None:
        while not stop.is_set():
            with contextlib.suppress(APIError):  # none SERVING after all
                return self.pool.pick()
            await self.pool.wait_ready(timeout=0.5)
        return None

    async def _call(self, engine: Engine, progress: _Progress, stop: asyncio.Event) -> bool:
        """One Batch call on `engine`; True if it failed or ended with lines unanswered (those are then to be
        sent again). When it returns, no line is in flight and its feeder takes no more lines."""
        window = asyncio.Semaphore(self.window or calls.in_flight_window(engine.info))
        ended = asyncio.Event()
        watcher = asyncio.ensure_future(stop.wait())
        failed = False
        try:
            feed = self._feed(progress, window, ended)
            with calls.holding(self.pool, engine), calls.open_batch_rpc(engine, feed, timeout=None) as call:
                watcher.add_done_callback(lambda _: call.cancel())
                async for response in call:
                    window.release()
                    self.in_flight -= 1
                    self._answer(response, progress)
        except asyncio.CancelledError:
            # grpc raises CancelledError from a call cancelled here; a cancelled task must still see it.
            if not stop.is_set() or _task_cancelled():
                raise
        except grpc.RpcError as error:  # `holding` has marked an UNAVAILABLE engine down
            if not stop.is_set():
                code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
                log.warning("batch call failed; sending its lines again", engine=engine.address,
                            code=getattr(code, "name", None), in_flight=len(progress.in_flight))
                failed = True
        finally:
            ended.set()
            self.in_flight = 0
            watcher.cancel()
            unanswered = list(progress.in_flight.values())
            progress.in_flight.clear()
            progress.retry.extend(unanswered)
        return failed or bool(unanswered)

    async def _feed(
        self, progress: _Progress, window: asyncio.Semaphore, ended: asyncio.Event
    ) -> AsyncIterator[engine_pb2.BatchRequest]:
        """The call's items: lines to send again first, then new lines, each item once the window has room.
        Stops at once when the call has `ended` (a line it holds is then in flight, and the call's end moves it
        to the retry queue)."""
        while not ended.is_set():
            pending = await self._take(progress, ended)
            if pending is None:
                return
            for k in pending.missing():
                await window.acquire()
                if ended.is_set():
                    return
                pending.outstanding += 1
                self.in_flight += 1
                yield calls.batch_item(f"{pending.line.index}:{k}", pending.requests[k])

    async def _take(self, progress: _Progress, ended: asyncio.Event) -> _Line | None:
        """Move the next line to send into `progress.in_flight` and return it: the first line to retry (once its
        pause is over), else the next unread line. None when there is none, or once the call has ended."""
        loop = asyncio.get_running_loop()
        while not ended.is_set():
            if progress.retry:
                head = progress.retry[0]
                pause = head.not_before - loop.time()
                if pause > 0 and head.error is None:
                    with contextlib.suppress(TimeoutError):  # the line stays queued while it waits
                        await asyncio.wait_for(ended.wait(), pause)
                    continue
                progress.retry.popleft()
                if head.error is not None:  # an item failed for good before its call was lost
                    progress.emit(self._result(head))
                    continue
                pending = head
            else:
                line = await progress.source.take(ended)
                if line is None:
                    return None
                pending = _Line(line, new_id(BATCH_REQUEST_PREFIX), [])
            if self._prepare(pending, progress):
                progress.in_flight[pending.line.index] = pending
                return pending
        return None

    def _prepare(self, pending: _Line, progress: _Progress) -> bool:
        """Give `pending` a fresh engine request id and build its requests; False if the line cannot be sent
        (it is then emitted as an error line)."""
        pending.request_id = "req_" + secrets.token_hex(12)  # a fresh engine id for every attempt
        try:
            pending.requests = lines.engine_requests(pending.line, pending.request_id, self.pool.model_info())
        except (APIError, ValueError) as exc:  # cannot happen for a validated line; a result all the same
            pending.error = exc if isinstance(exc, APIError) else APIError(400, f"body: {exc}", param="body")
            progress.emit(self._result(pending))
            return False
        if not pending.replies:
            pending.replies = [None] * len(pending.requests)
        pending.outstanding = 0
        return True

    def _answer(self, response: engine_pb2.BatchResponse, progress: _Progress) -> None:
        index, _, part = response.item_id.partition(":")
        pending = progress.in_flight.get(int(index))
        if pending is None:
            return
        pending.outstanding -= 1
        reply = calls.item_reply(response)
        if reply is not None:
            if _aborted(reply):  # the engine is draining or stopping: not a result, run it again
                pending.not_before = asyncio.get_running_loop().time() + self.pool.config.retry_after_s
            else:
                pending.replies[int(part)] = reply
        else:
            if grpc_status(response.error.code) in RETRYABLE_ITEM_CODES:
                pending.not_before = asyncio.get_running_loop().time() + self.pool.config.retry_after_s
            elif pending.error is None:
                pending.error = item_error(response.error, self.pool.config.retry_after_s)
        if pending.outstanding > 0:
            return
        del progress.in_flight[pending.line.index]
        if pending.error is None and pending.missing():
            progress.retry.append(pending)  # refused for load or aborted: again, after a moment
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


def _aborted(reply: calls.EngineReply) -> bool:
    """A generation that a draining engine aborted (a pooling item it cannot finish fails UNAVAILABLE instead)."""
    return isinstance(reply, engine_pb2.GenerateResponse) and any(
        choice.finish_reason == types_pb2.FINISH_REASON_ABORT for choice in reply.choices)


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
