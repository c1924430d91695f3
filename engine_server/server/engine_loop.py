"""The EngineCore on its own thread, behind the one seam the servicer uses: add / abort / outputs.

The core thread loops: drain the command queue (adds and aborts), step while there is work, publish what the
step produced. Outputs cross to asyncio through an outbox that the loop empties in one wake-up
(`loop.call_soon_threadsafe` once it has taken the last ones) and are routed there to one `RequestStream` per
submitted request. Nothing on the asyncio side ever touches the core (but for setting its thread-safe
`step_interrupt` when an INTERACTIVE request is added, which stops a running BATCH step), and the core thread
does no RPC work (no tokenizing, no detokenizing, no protobuf), so the step loop is never blocked by callers.
The seam carries only token-level values (`Request` in, `CoreOutput` out, errors), so the core could move to
its own process behind the same three calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from engine_server.core.engine_core import CoreOutput, EngineCore, coalesce
from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.frontend import split_core_request_id

log = structlog.get_logger(__name__)


class EngineInternalError(Exception):
    """A core step failed while running a request (a bug, a device error): the request is dropped, with every
    other request in that step; the server then checks the engine (see engine_server.server.server)."""


@dataclass(frozen=True)
class LoadSnapshot:
    """The core's load after its latest iteration; replaced whole, so a reader never sees a torn value."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_block_size: int = 0
    # Speculative decoding since start (engine_server.speculative.speculator.SpeculationStats); 0 without it.
    speculative_proposed_tokens: int = 0
    speculative_accepted_tokens: int = 0
    speculative_verified_rows: int = 0
    speculative_kept_histogram: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class _Add:
    request_id: str
    requests: Sequence[Request]
    wait: bool = False  # held while its class's queue is full, instead of refused (QueueFullError)

    @property
    def priority(self) -> Priority:
        return self.requests[0].priority

    def expired(self, now: float) -> bool:
        return any(r.deadline is not None and r.deadline <= now for r in self.requests)


@dataclass(frozen=True)
class _Abort:
    core_ids: Sequence[str]


@dataclass(frozen=True)
class _AbortAll:
    pass


_STOP = object()
_Command = _Add | _Abort | _AbortAll | object


class RequestStream:
    """The outputs of one submitted request (all of its choices), in step order, read on the event loop.

    Each `next()` returns the outputs one core step produced for this request, or raises the error the core
    reported for it (QueueFullError, ValueError on a duplicate id, EngineInternalError). A stream of `final_only`
    requests gets each choice once, when it finishes, with the tokens of all its steps (see EngineCore).
    """

    def __init__(self, request_id: str, core_ids: Sequence[str]) -> None:
        self.request_id = request_id
        self.core_ids = tuple(core_ids)
        self._queue: asyncio.Queue[list[CoreOutput] | BaseException] = asyncio.Queue()
        self._error: BaseException | None = None  # reported after the outputs that came before it

    async def next(self) -> list[CoreOutput]:
        """The outputs of the steps since the last call, merged per choice (`coalesce`): when the reader falls
        behind the core, several steps reach it as one, so its per-step work (detokenizing, one message per
        stream) shrinks as the load grows instead of piling up."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        outputs = list(item)
        while not self._queue.empty():
            more = self._queue.get_nowait()
            if isinstance(more, BaseException):
                self._error = more
                break
            outputs += more
        return coalesce(outputs)

    def _put(self, item: list[CoreOutput] | BaseException) -> None:
        self._queue.put_nowait(item)


class EngineLoop:
    """Runs an EngineCore on a dedicated thread. `add`, `abort` and `close` must be called on the event loop."""

    def __init__(self, core: EngineCore, loop: asyncio.AbstractEventLoop) -> None:
        self._core = core
        self._loop = loop
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._stream_of: dict[str, RequestStream] = {}  # event-loop side only: by core request id
        # Steps' outputs on their way to the event loop: the core thread appends, the loop takes them all at once
        # (one wake-up however many steps ran meanwhile, so a busy loop does less per step, not more).
        self._outbox: list[tuple[list[CoreOutput], dict[str, BaseException]]] = []
        self._outbox_lock = threading.Lock()
        self._dispatch_scheduled = False
        self._live: set[str] = set()  # core thread only: core ids added and not yet finished
        # Core thread only: adds that wait for room in their class's queue (`add(wait=True)`), in arrival order.
        self._held: deque[_Add] = deque()
        self._load = self._snapshot()
        # Stops a running BATCH step when an INTERACTIVE request is added (engine_server.step_interrupt); None
        # where steps cannot be stopped. The event loop sets it after queueing the command, the core thread
        # clears it before taking commands: a request added after the take stops the step that follows.
        self._interrupt = core.step_interrupt
        self.on_step_failure: Callable[[], None] | None = None  # called on the event loop after a failed step
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    @property
    def load(self) -> LoadSnapshot:
        return self._load

    @property
    def core(self) -> EngineCore:
        """The core; only its own thread may touch it once the loop runs."""
        return self._core

    def start(self) -> None:
        """Run the core on a new thread."""
        self._thread.start()

    def use_current_thread(self) -> None:
        """Make the calling thread the core's (instead of `start`); it must then call `run`."""
        self._thread = threading.current_thread()

    def run(self) -> None:
        """Run the core on the calling thread until `stop` (blocks); see `use_current_thread`."""
        if self._thread is not threading.current_thread():
            raise RuntimeError("call use_current_thread first, on the thread that runs the core")
        self._run()

    def stop(self) -> None:
        """Abort everything, stop the thread and wait for it (blocking: call it through asyncio.to_thread)."""
        self._commands.put(_AbortAll())
        self._commands.put(_STOP)
        self._thread.join()

    def add(
        self, request_id: str, requests: Sequence[Request], final_only: bool = False, wait: bool = False
    ) -> RequestStream:
        """Submit the core requests of one caller request (all of one priority); their outputs arrive on the
        returned stream (each choice only once it has finished, if `final_only`). When their class's queue is
        full the stream gets QueueFullError, or with `wait` the requests are held, in arrival order, until the
        queue has room: a held request whose deadline passes finishes FINISHED_DEADLINE, and an abort finishes
        it FINISHED_ABORTED, as if it had been queued. The Batch RPC waits: its reading ahead is bounded, and a
        caller's item is never refused for load the call itself caused."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = RequestStream(request_id, [r.request_id for r in requests])
        for request in requests:
            request.final_only = final_only  # before the core thread sees it
            self._stream_of[request.request_id] = stream
        self._streams[request_id] = stream
        self._commands.put(_Add(request_id, list(requests), wait))
        if self._interrupt is not None and any(request.priority is Priority.INTERACTIVE for request in requests):
            self._interrupt.set()
        return stream

    def abort(self, core_ids: Sequence[str]) -> None:
        """Abort core requests in any state; unknown or finished ids are ignored."""
        if core_ids:
            self._commands.put(_Abort(list(core_ids)))

    def abort_all(self) -> None:
        """Abort every request in the core (each stream then sees its choices finish as aborted)."""
        self._commands.put(_AbortAll())

    def fail_all(self, error: BaseException) -> int:
        """End every stream with `error` now, whatever the core is doing (it may never answer again: a lost
        tensor-parallel worker); returns how many. Event-loop side only."""
        streams = list(self._streams.values())
        for stream in streams:
            stream._put(error)
        return len(streams)

    def close(self, stream: RequestStream) -> None:
        """Stop routing outputs to `stream`; later outputs for its choices are dropped."""
        self._streams.pop(stream.request_id, None)
        for core_id in stream.core_ids:
            self._stream_of.pop(core_id, None)

    # -- event-loop side ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Route every step published since the last call: each stream gets one list of its outputs, in step
        order (an error goes after the outputs that came before it)."""
        with self._outbox_lock:
            published, self._outbox = self._outbox, []
            self._dispatch_scheduled = False
        routed: dict[RequestStream, list[CoreOutput]] = {}
        for outputs, errors in published:
            for output in outputs:
                stream = self._stream_of.get(output.request_id)
                if stream is not None:
                    routed.setdefault(stream, []).append(output)
            for request_id, error in errors.items():
                stream = self._streams.get(request_id)
                if stream is not None:
                    if stream in routed:
                        stream._put(routed.pop(stream))
                    stream._put(error)
        for stream, items in routed.items():
            stream._put(items)

    # -- core thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._interrupt is not None:
                self._interrupt.clear()
            # Held adds wait for room, which the last step may have just made: admit them before blocking.
            commands = self._drain(block=not self._core.has_unfinished() and not self._held)
            outputs: list[CoreOutput] = []
            errors: dict[str, BaseException] = {}
            stopping = False
            for command in commands:
                if command is _STOP:
                    stopping = True
                else:
                    self._apply(command, outputs, errors)
            if self._held:
                self._admit_held(outputs, errors)
            if not stopping and self._core.has_unfinished():
                self._step(outputs, errors)
            for output in outputs:
                if output.finished:
                    self._live.discard(output.request_id)
            self._load = self._snapshot()
            if outputs or errors:
                self._publish(outputs, errors)
            if stopping:
                self._core.close()  # on this thread: the tensor-parallel workers' channel is the core thread's
                return

    def _drain(self, block: bool) -> list[_Command]:
        commands: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command, outputs: list[CoreOutput], errors: dict[str, BaseException]) -> None:
        if isinstance(command, _Add):
            if command.wait and (self._held or not self._core.has_room(command.priority)):
                self._held.append(command)  # behind those already waiting for room: arrival order
            else:
                self._admit(command, errors)
        elif isinstance(command, _Abort):
            outputs.extend(self._core.abort_requests(list(command.core_ids)))
            if self._held:
                aborted = set(command.core_ids)
                outputs.extend(self._release_held(lambda c: any(r.request_id in aborted for r in c.requests),
                                                  RequestStatus.FINISHED_ABORTED))
        elif isinstance(command, _AbortAll):
            outputs.extend(self._core.abort_requests(sorted(self._live)))
            outputs.extend(self._release_held(lambda c: True, RequestStatus.FINISHED_ABORTED))

    def _admit(self, command: _Add, errors: dict[str, BaseException]) -> None:
        try:
            self._core.add_requests(command.requests)
        except Exception as exc:  # QueueFullError, a duplicate id: this request fails, nothing else does
            errors[command.request_id] = exc
            return
        self._live.update(r.request_id for r in command.requests)

    def _admit_held(self, outputs: list[CoreOutput], errors: dict[str, BaseException]) -> None:
        """Admit the held adds, in order, while their class has room; finish those whose deadline passed."""
        now = time.monotonic()
        outputs.extend(self._release_held(lambda c: c.expired(now), RequestStatus.FINISHED_DEADLINE))
        while self._held and self._core.has_room(self._held[0].priority):
            self._admit(self._held.popleft(), errors)

    def _release_held(self, which: Callable[[_Add], bool], status: RequestStatus) -> list[CoreOutput]:
        """Take the held adds `which` selects out of the queue, their requests finished with `status` (they never
        reached the core, so nothing else is to free)."""
        released = [c for c in self._held if which(c)]
        if not released:
            return []
        self._held = deque(c for c in self._held if not which(c))
        outputs: list[CoreOutput] = []
        for command in released:
            for request in command.requests:
                request.status = status
                outputs.append(CoreOutput(request.request_id, [], status))
        return outputs

    def _step(self, outputs: list[CoreOutput], errors: dict[str, BaseException]) -> None:
        try:
            outputs.extend(self._core.step())
        except Exception:
            self._core.check_workers()  # a lost tensor-parallel worker stops the process here
            # A bug in a step: fail the requests that were in it rather than the process. Aborting frees
            # their blocks, so whoever comes next starts from a clean scheduler.
            log.exception("engine step failed; failing the requests in flight", num_requests=len(self._live))
            failed = sorted(self._live)
            try:
                self._core.abort_requests(failed)
            except Exception:
                log.exception("aborting after a failed step failed too")
            self._live.clear()
            for request_id in {split_core_request_id(core_id)[0] for core_id in failed}:
                errors[request_id] = EngineInternalError("the engine failed a step while running this request")
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody to tell
                self._loop.call_soon_threadsafe(self._step_failed)

    def _step_failed(self) -> None:
        if self.on_step_failure is not None:
            self.on_step_failure()

    def _publish(self, outputs: list[CoreOutput], errors: dict[str, BaseException]) -> None:
        with self._outbox_lock:
            self._outbox.append((outputs, errors))
            if self._dispatch_scheduled:
                return  # the loop has not taken the last ones yet: these go with them
            self._dispatch_scheduled = True
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._dispatch)

    def _snapshot(self) -> LoadSnapshot:
        scheduler = self._core.scheduler
        kv = scheduler.kv_cache
        speculator = self._core.speculator
        stats = speculator.stats if speculator is not None else None
        return LoadSnapshot(
            running=scheduler.num_running,
            waiting=scheduler.num_waiting + sum(len(c.requests) for c in self._held),
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            kv_block_size=kv.block_size,
            speculative_proposed_tokens=stats.proposed_tokens if stats else 0,
            speculative_accepted_tokens=stats.accepted_tokens if stats else 0,
            speculative_verified_rows=stats.verified_rows if stats else 0,
            speculative_kept_histogram=tuple(stats.kept_histogram) if stats else (),
        )
