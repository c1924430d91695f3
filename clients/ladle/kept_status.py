"""A stream-request call that reports the status the server ended it with, not the failed write that followed.

grpc.aio (through grpcio 1.85, grpc/grpc#36066) loses the status of a call whose server ends it while the
client is still writing: the server sends its status and resets the stream, a write still under way then fails,
and grpc.aio sets the call's status to INTERNAL "Internal error from Core" over the server's own. For a Batch
call refused at its start (UNAUTHENTICATED, UNAVAILABLE while the engine drains) this happened to ~85% of calls of
8 or more items on loopback, and a caller that acts on the code (fail over, mark the engine down, report the
token) saw an internal error instead.

`KeptStatusCall` wraps such a call and keeps the first status the call receives (a done callback runs as the
status is set, before the failed write overwrites it). Its errors, `code()`, `details()` and trailing metadata
are that status's. When the first status is grpc's own write failure (the server's never came first), it is not
kept and the call answers as grpc does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from grpc.aio import EOF, Metadata  # type: ignore[attr-defined]  # EOF: read()'s end, missing from grpc-stubs

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
T = TypeVar("T")

WRITE_FAILURE_DETAILS = "Internal error from Core"  # what grpc.aio sets when a write fails


@dataclass(frozen=True)
class Status:
    """A finished call's status, as the call first received it."""

    code: grpc.StatusCode
    details: str | None
    trailing_metadata: Metadata | None

    def error(self, initial_metadata: Metadata) -> grpc.aio.AioRpcError:
        trailing = self.trailing_metadata or Metadata()
        return grpc.aio.AioRpcError(self.code, initial_metadata, trailing, self.details, None)


class KeptStatusCall(grpc.aio.StreamStreamCall[RequestT, ResponseT], Generic[RequestT, ResponseT]):
    """`call` with the status it first received (see the module). Everything else is `call`'s own."""

    def __init__(self, call: grpc.aio.StreamStreamCall[RequestT, ResponseT]) -> None:
        self._call = call
        self._kept: Status | None = None
        call.add_done_callback(self._keep)

    def _keep(self, call: grpc.aio.Call) -> None:
        """Runs as `call`'s first status is set: reads it at once, before anything can replace it."""
        code = _now(call.code())
        details = _now(call.details())
        if code is None or (code is grpc.StatusCode.INTERNAL and details == WRITE_FAILURE_DETAILS):
            return
        self._kept = Status(code, details, _now(call.trailing_metadata()))

    async def _raise_kept(self, error: grpc.aio.AioRpcError) -> None:
        """Raises `error`, or the kept status's error when the call first received another status; returns when
        that status is OK (the call ended well, and only a write failed after)."""
        kept = self._kept
        if kept is None or (kept.code, kept.details) == (error.code(), error.details()):
            raise error
        if kept.code is not grpc.StatusCode.OK:
            raise kept.error(await self._call.initial_metadata()) from None

    async def _checked(self, operation: Coroutine[Any, Any, T], default: T) -> T:
        """`operation`'s result; its error replaced by the kept status's (`default` when that is OK)."""
        try:
            return await operation
        except grpc.aio.AioRpcError as error:
            await self._raise_kept(error)
            return default

    def __aiter__(self) -> AsyncIterator[ResponseT]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[ResponseT]:
        responses = aiter(self._call)
        while True:
            try:
                response = await anext(responses)
            except StopAsyncIteration:
                return
            except grpc.aio.AioRpcError as error:
                await self._raise_kept(error)
                return
            yield response

    async def read(self) -> Any:
        """The next response, or grpc.aio.EOF at the end."""
        return await self._checked(self._call.read(), EOF)

    async def write(self, request: RequestT) -> None:
        await self._checked(self._call.write(request), None)

    async def done_writing(self) -> None:
        await self._call.done_writing()

    async def wait_for_connection(self) -> None:
        await self._checked(self._call.wait_for_connection(), None)

    async def code(self) -> grpc.StatusCode:
        code = await self._call.code()
        return self._kept.code if self._kept is not None else code

    async def details(self) -> str:
        details = await self._call.details()
        return self._kept.details or "" if self._kept is not None else details

    async def trailing_metadata(self) -> Metadata:
        metadata = await self._call.trailing_metadata()
        kept = self._kept.trailing_metadata if self._kept is not None else None
        return kept if kept is not None else metadata

    async def initial_metadata(self) -> Metadata:
        return await self._call.initial_metadata()

    def cancel(self) -> bool:
        return self._call.cancel()

    def cancelled(self) -> bool:
        return self._call.cancelled()

    def done(self) -> bool:
        return self._call.done()

    def time_remaining(self) -> float | None:
        return self._call.time_remaining()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """`callback(self)` once the call is done."""
        self._call.add_done_callback(lambda _: callback(self))


def _now(operation: Coroutine[Any, Any, T]) -> T | None:
    """`operation`'s result if it completes without waiting (a finished call's status getters do), else None."""
    try:
        operation.send(None)
    except StopIteration as finished:
        return finished.value
    operation.close()
    return None
