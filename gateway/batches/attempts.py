"""A batch line's attempts: the id each send carries, why an attempt failed, and when a line is given up.

Every send of a line is an attempt with a number of its own, carried in its Batch item ids
(`{line index}:{attempt}:{part}`), so an engine never sees an id twice in one call and a reply of an earlier
attempt is recognised as stale. An attempt fails, without being the line's result, when its call fails while
it is in flight, when an item is refused for load (RESOURCE_EXHAUSTED, UNAVAILABLE, …) or when the engine aborts
it (draining). Failures are bounded (`AttemptLimits`): after `shared` of them among other lines the line runs in
a Batch call of its own, so a call it breaks (a reply over the message limit, a proxy's idle timeout, an engine
it crashes) no longer takes the others with it; after `alone` more it becomes an error line that says why. A
line's count outlives the claim that ran it (`LineFailures`, committed with the batch's results), so a worker
that dies or loses its lease does not give a poison line a fresh set of attempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from gateway.batches.lines import InputLine
from gateway.errors import APIError, message_too_large
from gateway.store.batches import LineFailures

if TYPE_CHECKING:  # not at run time: calls imports the engine pool
    from gateway.calls import EngineReply, EngineRequest

ABORTED = "the engine aborted it (it was draining or stopping)"


@dataclass(frozen=True)
class AttemptLimits:
    """Failed attempts a line may have: `shared` among other lines, then `alone` in calls of its own."""

    shared: int = 3
    alone: int = 2

    def __post_init__(self) -> None:
        if self.shared < 1 or self.alone < 1:
            raise ValueError("a line needs at least one attempt among others and one alone")


@dataclass
class PendingLine:
    """A line between its first send and its result, and the state of its current attempt."""

    line: InputLine
    line_id: str
    replies: list[EngineReply | None] = field(default_factory=list)  # kept across attempts: parts answered once
    request_id: str = ""  # the engine request id of the current attempt
    requests: list[EngineRequest] = field(default_factory=list)  # the current attempt's, one per part
    attempt: int = 0
    error: APIError | None = None  # a part failed for good: the line's result is this error
    failure: str | None = None  # why the current attempt failed (it will be sent again), if it did
    sending: bool = False  # the current attempt still has parts to send
    outstanding: int = 0  # parts of the current attempt sent and not yet answered
    sent: int = 0  # parts of the current attempt sent
    failures: int = 0  # attempts that failed so far
    failures_alone: int = 0  # of them, in a call of its own
    last_failure: str = ""
    alone: bool = False  # failed `AttemptLimits.shared` times among others: runs in a call of its own
    not_before: float = 0.0  # loop time before which it is not sent again

    def restore(self, recorded: LineFailures, limits: AttemptLimits) -> None:
        """Take up the failed attempts an earlier claim recorded."""
        self.failures, self.failures_alone, self.last_failure = (
            recorded.failures, recorded.failures_alone, recorded.last_error)
        self.alone = self.failures >= limits.shared

    def recorded(self) -> LineFailures:
        return LineFailures(self.failures, self.failures_alone, self.last_failure)

    def begin(self, request_id: str, requests: list[EngineRequest]) -> None:
        """Start a new attempt with fresh engine request ids."""
        self.attempt += 1
        self.request_id, self.requests = request_id, requests
        if not self.replies:
            self.replies = [None] * len(requests)
        self.failure, self.sending, self.outstanding, self.sent = None, True, 0, 0

    def item_id(self, part: int) -> str:
        return f"{self.line.index}:{self.attempt}:{part}"

    def missing(self) -> list[int]:
        return [k for k, reply in enumerate(self.replies) if reply is None]

    @property
    def settled(self) -> bool:
        """Every part of the current attempt that will be sent was sent and answered."""
        return not self.sending and self.outstanding == 0

    def fail(self, why: str) -> None:
        """The current attempt failed (its first reason is kept)."""
        if self.failure is None:
            self.failure = why

    def count_failure(self, limits: AttemptLimits) -> bool:
        """Count the failed attempt; True if the line is to be given up (it failed `limits.alone` times alone)."""
        self.failures += 1
        self.last_failure = self.failure or "unknown"
        if self.alone:
            self.failures_alone += 1
            return self.failures_alone >= limits.alone
        self.alone = self.failures >= limits.shared
        return False

    def gave_up(self) -> APIError:
        """The error line of a line that failed every attempt."""
        if self.last_failure.startswith(REPLY_TOO_LARGE):
            return APIError(500, f"{self.last_failure}; ask for fewer tokens, choices (n) or top_logprobs",
                            type="server_error", code="reply_too_large")
        return APIError(500, f"the request failed {self.failures} times, the last {self.failures_alone} in a call "
                        f"of its own; the last error was: {self.last_failure}", type="server_error", code="line_failed")


REPLY_TOO_LARGE = "its reply is larger than the gRPC message limit"


def parse_item_id(item_id: str) -> tuple[int, int, int] | None:
    """(line index, attempt, part) of a Batch item id this module made; None for any other."""
    parts = item_id.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    index, attempt, part = (int(p) for p in parts)
    return index, attempt, part


def call_failure(error: grpc.RpcError) -> str:
    """Why a Batch call failed, as an attempt's failure: the reply-size refusal named as such."""
    code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
    details = (error.details() if isinstance(error, grpc.aio.AioRpcError) else None) or str(error)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and message_too_large(details):
        return f"{REPLY_TOO_LARGE} ({details})"
    return f"the Batch call failed with {getattr(code, 'name', 'an error')}: {details}"
