"""Run a batch job's lines through an engine's Batch RPC until each has exactly one result.

Lines stream into one Batch call at a time (`gateway.calls`: the engine held, and marked down if the call ends
UNAVAILABLE) with at most `window` engine items unanswered (by default `calls.in_flight_window`: the engine reads
a call about twice its `max_num_seqs` ahead, so more would only sit in buffers), and, when a `project_window` is
given, at most its permits over every batch of the project that shares it. Each line's result is handed to
`emit` as soon as all of its engine items have answered (generations, or Embed / Score requests for the pooling
endpoints). Any item error that is not about load is that line's result: an error line with the HTTP status
the route would have answered. A line's images and audio are fetched before it is taken, a few lines
ahead (`line_media`); files that cannot be had are that line's error line too (400, as the route answers).

Every send of a line is an attempt (`attempts.PendingLine`) with fresh item and request ids. An attempt fails
without being a result when its call fails while it is in flight (the engine died, restarts or drains; the call
broke), when an item is refused for load or aborted by a draining engine: the line is sent again, on the next
SERVING engine if the call failed, keeping the parts that already answered. Failures are bounded
(`attempts.AttemptLimits`): a line that keeps failing runs in a call of its own (the shared call first ends, so
it runs alone), and if it still fails it becomes an error line saying why.

The invariant: every line is, at every moment, in exactly one of five places — unread (in `source`, or read and
not yet taken), in flight (`_Progress.in_flight`), to retry (`_Progress.retry`), to run alone
(`_Progress.suspects`) or emitted. A line moves between them only in code that does not await in between; a line
leaves `in_flight` only once every part of its attempt that was sent has answered (or its call has ended), and a
call's feeder stops taking lines the moment its call has ended, so no interleaving of a call's end with a
feeder's pause can leave a line nowhere, nor send a part of a line no longer in flight.

LoRA adapters: a generation line whose `model` names an adapter (`lines.line_adapter`) is sent with it. A Batch
call runs on one engine, so a line whose adapter that engine does not hold, while another SERVING engine does, is
not sent there: it goes back to the head of the lines to retry (no failure counted), the call ends once its
feeder stops, and the next call goes to an engine that holds that adapter (`EnginePool.pick`). When every engine
serves the same adapters (the gateway loads them on all), no call ends early.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from gateway import calls
from gateway.batches import lines
from gateway.batches.attempts import ABORTED, AttemptLimits, PendingLine, call_failure, parse_item_id
from gateway.batches.line_media import LinesWithMedia
from gateway.batches.lines import InputLine
from gateway.engines import Engine, EnginePool
from gateway.errors import APIError, grpc_status, item_error
from gateway.media import MediaFetcher
from gateway.store.batches import LineFailures
from gateway.store.ids import BATCH_REQUEST_PREFIX, new_id
from ladle.v1 import engine_pb2, types_pb2

log = structlog.get_logger(__name__)

RETRYABLE_ITEM_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
})
BACKOFF_S = 0.2  # the pause after a failed call; doubled after each further one in a row, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 5.0
UNANSWERED = "the engine ended the Batch call without answering it"


@dataclass(frozen=True)
class LineResult:
    """The one result of a line: the record for the output file (`ok`) or the error file, and its usage."""

    line: InputLine
    record: dict[str, Any]
    ok: bool
    usage: tuple[types_pb2.Usage, ...] = ()


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
    retry: deque[PendingLine] = field(default_factory=deque)
    suspects: deque[PendingLine] = field(default_factory=deque)  # to run in a call of their own
    in_flight: dict[int, PendingLine] = field(default_factory=dict)  # by line index

    @property
    def finished(self) -> bool:
        return self.source.done and not self.retry and not self.suspects and not self.in_flight


class _Permits:
    """The permits of a project's shared window one call holds: one per item sent and not yet answered. Once
    `close`d (its call ended) it holds none, and a permit its feeder obtains afterwards is handed straight back."""

    def __init__(self, window: asyncio.Semaphore | None) -> None:
        self.window = window
        self.held = 0
        self.closed = False

    async def acquire(self) -> None:
        if self.window is None:
            return
        await self.window.acquire()
        if self.closed:
            self.window.release()
        else:
            self.held += 1

    def release(self) -> None:
        if self.window is not None and self.held:
            self.held -= 1
            self.window.release()

    def close(self) -> None:
        self.closed = True
        while self.held:
            self.release()


class LineRunner:
    """Runs lines on the engines of `pool`. `model` is the id written into response bodies; `cache_salt` goes on
    every engine request (the batch's project's prefix-cache namespace); `project_window` bounds the items in
    flight of every runner that shares it (one per project). `failures` are the failed attempts earlier runs
    recorded, by custom_id; `on_failure` is told each line's count whenever it grows, to record it. After a call
    that failed, the next one waits `backoff_s`, doubled after each further failed call in a row up to
    `max_backoff_s` (tests of many faults set them small). `media` fetches the lines' images and audio a few lines ahead
    (`line_media`; None: a fetcher with the default limits, opened and closed by each run)."""

    def __init__(
        self,
        pool: EnginePool,
        model: str,
        window: int | None = None,
        *,
        cache_salt: str = "",
        project_window: asyncio.Semaphore | None = None,
        limits: AttemptLimits | None = None,
        failures: Mapping[str, LineFailures] | None = None,
        on_failure: Callable[[str, LineFailures], None] | None = None,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        media: MediaFetcher | None = None,
    ) -> None:
        self.pool = pool
        self.media = media
        self.model = model
        self.window = window
        self.cache_salt = cache_salt
        self.project_window = project_window
        self.limits = limits or AttemptLimits()
        self.failures = failures or {}
        self.on_failure = on_failure
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.in_flight = 0  # engine items sent and not yet answered
        self._adapter = ""  # the LoRA adapter the next call's engine should hold: that of a line sent back for it

    async def run(
        self, source: AsyncIterator[InputLine], emit: Callable[[LineResult], None], stop: asyncio.Event
    ) -> bool:
        """Run every line of `source` once, calling `emit` with each result as it is final. Returns True once
        every line has its result, False as soon as `stop` is set (lines then in flight are cancelled in the
        engine and have no result)."""
        media = self.media or MediaFetcher()
        lines_in = LinesWithMedia(source, media)
        progress = _Progress(emit, _Source(lines_in))
        backoff = self.backoff_s
        try:
            while not stop.is_set():
                if progress.finished:
                    if progress.source.error is not None:
                        raise progress.source.error
                    return True
                adapter = self._adapter  # a line to run alone goes to an engine with its own adapter
                if progress.suspects:
                    adapter = lines.line_adapter(progress.suspects[0].line, self.model)
                engine = await self._serving_engine(stop, adapter)
                if engine is None:
                    break
                alone = progress.suspects.popleft() if progress.suspects else None
                failed = await self._call(engine, progress, stop, alone)
                if progress.source.error is not None:
                    raise progress.source.error
                if failed and not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)
                elif not failed:
                    backoff = self.backoff_s
            return False
        finally:
            progress.source.close()
            lines_in.close()
            if self.media is None:
                await media.aclose()

    async def _serving_engine(self, stop: asyncio.Event, adapter: str) -> Engine | None:
        while not stop.is_set():
            with contextlib.suppress(APIError):  # none SERVING after all
                return self.pool.pick(adapter=adapter)
            await self.pool.wait_ready(timeout=0.5)
        return None

    async def _call(
        self, engine: Engine, progress: _Progress, stop: asyncio.Event, alone: PendingLine | None
    ) -> bool:
        """One Batch call on `engine` (with only `alone` in it, when given); True if it failed or ended with
        lines unanswered (those are then to be sent again). When it returns, no line is in flight and its feeder
        takes no more lines."""
        window = asyncio.Semaphore(1 if alone else self.window or calls.in_flight_window(engine.info))
        permits = _Permits(self.project_window)
        ended = asyncio.Event()
        watcher = asyncio.ensure_future(stop.wait())
        failure: str | None = None
        try:
            feed = self._feed(engine, progress, window, permits, ended, alone)
            with calls.holding(self.pool, engine), calls.open_batch_rpc(engine, feed, timeout=None) as call:
                watcher.add_done_callback(lambda _: call.cancel())
                async for response in call:
                    window.release()
                    permits.release()
                    self.in_flight -= 1
                    self._answer(response, progress)
        except asyncio.CancelledError:
            # grpc raises CancelledError from a call cancelled here; a cancelled task must still see it.
            if not stop.is_set() or _task_cancelled():
                raise
        except grpc.RpcError as error:  # `holding` has marked an UNAVAILABLE engine down
            if not stop.is_set():
                failure = call_failure(error)
                log.warning("batch call failed; sending its lines again", engine=engine.address, error=failure,
                            in_flight=len(progress.in_flight), alone=alone is not None)
        finally:
            ended.set()
            self.in_flight = 0
            permits.close()
            watcher.cancel()
            unanswered = list(progress.in_flight.values())
            progress.in_flight.clear()
            for pending in unanswered:
                self._call_ended(pending, progress, failure, stop.is_set())
        return failure is not None or bool(unanswered)

    def _call_ended(self, pending: PendingLine, progress: _Progress, failure: str | None, stopped: bool) -> None:
        """A line still in flight when its call ended: sent again, its attempt counted as failed unless the
        batch is stopping or none of its parts was sent."""
        pending.sending, pending.outstanding = False, 0
        if stopped or (pending.sent == 0 and pending.error is None):
            progress.retry.appendleft(pending)  # not its failure: first in line for the next call
            return
        pending.fail(failure or UNANSWERED)
        self._settle(pending, progress)

    async def _feed(
        self, engine: Engine, progress: _Progress, window: asyncio.Semaphore, permits: _Permits,
        ended: asyncio.Event, alone: PendingLine | None,
    ) -> AsyncIterator[engine_pb2.BatchRequest]:
        """The call's items: `alone`'s only, or lines to send again first, then new lines; each item once the
        windows have room. Stops at once when the call has `ended` (a line it holds is then in flight, and the
        call's end moves it on), and sends no more parts of an attempt that has already failed."""
        while not ended.is_set():
            pending = self._begin(alone, progress) if alone is not None else await self._take(engine, progress, ended)
            if pending is None:
                return
            for part in pending.missing():
                await window.acquire()
                await permits.acquire()
                if ended.is_set():
                    return
                if pending.failure is not None or pending.error is not None:
                    window.release()
                    permits.release()
                    break
                pending.outstanding += 1
                pending.sent += 1
                self.in_flight += 1
                yield calls.batch_item(pending.item_id(part), pending.requests[part])
            pending.sending = False
            if pending.outstanding == 0:
                self._settle(pending, progress)
            if alone is not None:
                return

    async def _take(self, engine: Engine, progress: _Progress, ended: asyncio.Event) -> PendingLine | None:
        """Move the next line to send into `progress.in_flight` and return it: the first line to retry (once its
        pause is over), else the next unread line. None when there is none, once the call has ended, once a
        line waits to run alone (this call then ends first), or once a line needs a LoRA adapter that `engine`
        lacks and another engine holds (it goes back to the head of the retries, and this call ends first)."""
        loop = asyncio.get_running_loop()
        while not ended.is_set() and not progress.suspects:
            if progress.retry:
                head = progress.retry[0]
                pause = head.not_before - loop.time()
                if pause > 0:
                    with contextlib.suppress(TimeoutError):  # the line stays queued while it waits
                        await asyncio.wait_for(ended.wait(), pause)
                    continue
                pending = progress.retry.popleft()
            else:
                line = await progress.source.take(ended)
                if line is None:
                    return None
                pending = PendingLine(line, new_id(BATCH_REQUEST_PREFIX))
                if (recorded := self.failures.get(line.custom_id)) is not None:
                    pending.restore(recorded, self.limits)
                    if pending.alone:  # it failed too often among others before: it runs in a call of its own
                        progress.suspects.append(pending)
                        continue
            adapter = lines.line_adapter(pending.line, self.model)
            if adapter and not engine.holds(adapter) and any(e.holds(adapter) for e in self.pool.ready):
                progress.retry.appendleft(pending)  # for the next call, on an engine that holds the adapter
                self._adapter = adapter
                return None
            if (begun := self._begin(pending, progress)) is not None:
                return begun
        return None

    def _begin(self, pending: PendingLine, progress: _Progress) -> PendingLine | None:
        """Start `pending`'s next attempt (fresh engine request ids) and put it in flight; None if it cannot be
        sent (it is then emitted as an error line)."""
        request_id = "req_" + secrets.token_hex(12)
        try:
            requests = lines.engine_requests(pending.line, request_id, self.pool.model_info(),
                                             cache_salt=self.cache_salt,
                                             adapter=lines.line_adapter(pending.line, self.model))
        except (APIError, ValueError) as exc:  # cannot happen for a validated line; a result all the same
            pending.error = exc if isinstance(exc, APIError) else APIError(400, f"body: {exc}", param="body")
            pending.request_id = request_id
            progress.emit(self._result(pending))
            return None
        pending.begin(request_id, requests)
        progress.in_flight[pending.line.index] = pending
        return pending

    def _answer(self, response: engine_pb2.BatchResponse, progress: _Progress) -> None:
        parsed = parse_item_id(response.item_id)
        pending = progress.in_flight.get(parsed[0]) if parsed is not None else None
        if parsed is None or pending is None or pending.attempt != parsed[1]:
            return  # not an item of an attempt in flight: a stale reply
        part = parsed[2]
        pending.outstanding -= 1
        reply = calls.item_reply(response)
        if reply is not None:
            if _aborted(reply):  # the engine is draining or stopping: not a result, run it again
                pending.fail(ABORTED)
            else:
                pending.replies[part] = reply
        elif (code := grpc_status(response.error.code)) in RETRYABLE_ITEM_CODES:
            pending.fail(f"the engine refused it ({code.name}: {response.error.message})")
        elif pending.error is None:
            pending.error = item_error(response.error, self.pool.config.retry_after_s)
        if pending.settled:
            self._settle(pending, progress)

    def _settle(self, pending: PendingLine, progress: _Progress) -> None:
        """The attempt is over: emit the line's result, or count the failure and queue the line again (to retry
        after a pause, or alone), or, past its limits, emit it as an error line."""
        progress.in_flight.pop(pending.line.index, None)
        if pending.error is None and (pending.failure is not None or pending.missing()):
            pending.fail(UNANSWERED)
            given_up = pending.count_failure(self.limits)
            if self.on_failure is not None:
                self.on_failure(pending.line.custom_id, pending.recorded())
            if not given_up:
                self._requeue(pending, progress)
                return
            log.warning("batch line failed every attempt; it becomes an error line", custom_id=pending.line.custom_id,
                        failures=pending.failures, last_error=pending.last_failure)
            pending.error = pending.gave_up()
        progress.emit(self._result(pending))

    def _requeue(self, pending: PendingLine, progress: _Progress) -> None:
        if pending.alone:
            progress.suspects.append(pending)
            return
        pending.not_before = asyncio.get_running_loop().time() + self.pool.config.retry_after_s
        progress.retry.append(pending)

    def _result(self, pending: PendingLine) -> LineResult:
        """The line's result record; a reply the response body cannot be built from is that line's error (a
        500 naming why), never the batch's."""
        line = pending.line
        replies = [r for r in pending.replies if r is not None]
        if pending.error is None:
            try:
                model = lines.line_adapter(line, self.model) or self.model  # an adapter's answer names it
                body = lines.response_body(line, replies, pending.request_id, model)
            except Exception as exc:
                log.exception("a batch line's result could not be built", custom_id=line.custom_id)
                pending.error = APIError(500, f"the engine's reply could not be turned into a response "
                                         f"({type(exc).__name__}: {exc})", type="server_error", code="internal_error")
            else:
                record = lines.output_record(pending.line_id, line.custom_id, pending.request_id, 200, body)
                return LineResult(line, record, ok=True, usage=tuple(r.usage for r in replies))
        record = lines.output_record(pending.line_id, line.custom_id, pending.request_id, pending.error.status,
                                     pending.error.body())
        return LineResult(line, record, ok=False)


def _aborted(reply: calls.EngineReply) -> bool:
    """A generation that a draining engine aborted (a pooling item it cannot finish fails UNAVAILABLE instead)."""
    return isinstance(reply, engine_pb2.GenerateResponse) and any(
        choice.finish_reason == types_pb2.FINISH_REASON_ABORT for choice in reply.choices)


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
