"""An engine stream -> the Responses API's semantic streaming events, as `client.responses.stream()` reads them.

The order, per response: `response.created`, `response.in_progress`; then for each output item as the engine
produces it: `response.output_item.added`, for a reasoning item or a message a `response.content_part.added` and
its `response.reasoning_text.delta` / `response.output_text.delta` events, for a function call its
`response.function_call_arguments.delta` events; each item ends with its `…done` events and
`response.output_item.done`. Last comes `response.completed` (or `response.incomplete`, cut at
max_output_tokens), carrying the whole Response — the same items `responses_from_engine.from_reply` makes of the
whole reply. Every event has the next `sequence_number`. An item is closed when the next kind of output starts
(reasoning, then the answer, then tool calls, as the engine splits a choice).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import APIError
from gateway.translate import from_engine as out_engine
from gateway.translate import responses_from_engine as out
from gateway.translate.responses_to_engine import new_item_id
from ladle.v1 import engine_pb2, types_pb2

Event = dict[str, Any]


@dataclass
class _OpenItem:
    """The output item being streamed: its position, its item dict and the text or arguments so far."""

    index: int
    item: dict[str, Any]
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponseEvents:
    """The events of one streamed response, built delta by delta (`start`, `delta`, `finish`)."""

    def __init__(self, shell: dict[str, Any], want_logprobs: bool) -> None:
        self.shell = shell
        self.want_logprobs = want_logprobs
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.open: _OpenItem | None = None
        self.calls: dict[int, _OpenItem] = {}  # the choice's tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[Event]:
        return [self.event("response.created", response=self.shell),
                self.event("response.in_progress", response=self.shell)]

    def delta(self, delta: types_pb2.ChoiceDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content, [])
        if delta.text or (delta.logprobs and not delta.reasoning_content):
            logprobs = out.logprobs(delta.logprobs) if self.want_logprobs else []
            events += self._text("message", delta.text, logprobs)
        for call in delta.tool_calls:
            if call.index == 0 or self.shell["parallel_tool_calls"]:  # `parallel_tool_calls` false: the first alone
                events += self._call(call)
        return events

    def finish(
        self, finish: types_pb2.FinishReason.ValueType, usage: types_pb2.Usage
    ) -> tuple[list[Event], dict[str, Any]]:
        """The closing events and the final Response (to be stored before the last event is sent)."""
        status = "incomplete" if finish in out.INCOMPLETE_REASONS else "completed"
        events: list[Event] = []
        if not self.output and self.open is None:  # nothing at all: an empty answer, as from_reply makes it
            events += self._text("message", "", [])
        events += self._close(status)
        response = out.finished(self.shell, self.output, finish, usage)
        return events, response

    def last(self, response: dict[str, Any]) -> Event:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed")
        return self.event(kind, response=response)

    def failure(self, error: APIError) -> list[Event]:
        """An `error` event and `response.failed` for a stream that failed after it started."""
        response = out.failed(dict(self.shell, output=self.output), error.code or error.type, error.message)
        return [self.event("error", code=error.code or error.type, message=error.message, param=error.param),
                self.event("response.failed", response=response)]

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open.item["type"] != kind:
            events += self._close("completed")
            events += self._open_text(kind)
        assert self.open is not None
        self.open.text += text
        self.open.logprobs += logprobs
        ids = {"item_id": self.open.item["id"], "output_index": self.open.index, "content_index": 0}
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", delta=text, **ids))
        else:
            events.append(self.event("response.output_text.delta", delta=text, logprobs=logprobs, **ids))
        return events

    def _open_text(self, kind: str) -> list[Event]:
        item_id = new_item_id(kind)
        if kind == "reasoning":
            item, part = out.reasoning_item(item_id, "", "in_progress"), {"type": "reasoning_text", "text": ""}
            item["content"] = []
        else:
            item = out.message_item(item_id, [], "in_progress")
            part = out.output_text_part("", [] if self.want_logprobs else None)
        self.open = _OpenItem(len(self.output) + len(self.calls), item)
        ids = {"item_id": item_id, "output_index": self.open.index, "content_index": 0}
        return [self.event("response.output_item.added", output_index=self.open.index, item=item),
                self.event("response.content_part.added", part=part, **ids)]

    def _call(self, delta: types_pb2.ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        call = self.calls.get(delta.index)
        if call is None:
            events += self._close("completed")
            item = out.function_call_item(new_item_id("function_call"), delta.id, delta.name, "", "in_progress")
            call = self.calls[delta.index] = _OpenItem(len(self.output) + len(self.calls), item)
            events.append(self.event("response.output_item.added", output_index=call.index, item=dict(item)))
        if delta.arguments_json_delta:
            call.text += delta.arguments_json_delta
            events.append(self.event("response.function_call_arguments.delta", delta=delta.arguments_json_delta,
                                     item_id=call.item["id"], output_index=call.index))
        return events

    def _close(self, status: str) -> list[Event]:
        """Close the open reasoning or message item, then every tool call, each with its `…done` events."""
        events: list[Event] = []
        if self.open is not None:
            events += self._close_text(self.open, status)
            self.open = None
        for call in sorted(self.calls.values(), key=lambda c: c.index):
            item = dict(call.item, arguments=call.text, status=status)
            ids = {"item_id": item["id"], "output_index": call.index}
            events.append(self.event("response.function_call_arguments.done", arguments=call.text, **ids))
            events.append(self.event("response.output_item.done", output_index=call.index, item=item))
            self.output.append(item)
        self.calls.clear()
        return events

    def _close_text(self, open_item: _OpenItem, status: str) -> list[Event]:
        ids = {"item_id": open_item.item["id"], "output_index": open_item.index, "content_index": 0}
        if open_item.item["type"] == "reasoning":
            item = out.reasoning_item(open_item.item["id"], open_item.text, status)
            part: dict[str, Any] = {"type": "reasoning_text", "text": open_item.text}
            events = [self.event("response.reasoning_text.done", text=open_item.text, **ids)]
        else:
            part = out.output_text_part(open_item.text, open_item.logprobs if self.want_logprobs else None)
            item = out.message_item(open_item.item["id"], [part], status)
            events = [self.event("response.output_text.done", text=open_item.text,
                                 logprobs=open_item.logprobs, **ids)]
        events.append(self.event("response.content_part.done", part=part, **ids))
        events.append(self.event("response.output_item.done", output_index=open_item.index, item=item))
        self.output.append(item)
        return events


async def response_events(
    messages: AsyncIterator[engine_pb2.StreamResponse], events: ResponseEvents,
    on_finished: Callable[[dict[str, Any]], Awaitable[None]], on_output: Callable[[], None],
    on_ended: Callable[[types_pb2.Usage], None],
) -> AsyncIterator[Event]:
    """The events of the streamed response. `on_finished(response)` runs before the last event is sent (so a stored
    response can be retrieved, and continued, once a client has seen it end); `on_output()` after each engine
    message (the route's latency metrics); `on_ended(engine usage)` once, however the stream ends: finished,
    failed, or left by its client (then with what the engine's last message said it had used so far). A failure
    of the engine stream after the start becomes an `error` and a `response.failed` event."""
    for event in events.start():
        yield event
    finish: types_pb2.FinishReason.ValueType = types_pb2.FINISH_REASON_UNSPECIFIED
    usage = types_pb2.Usage()
    try:
        try:
            async for message in messages:
                on_output()
                usage = out_engine.used(message)
                for delta in message.choices:
                    for event in events.delta(delta):
                        yield event
                    if delta.finish_reason:
                        finish = delta.finish_reason
        finally:
            on_ended(usage)
    except APIError as error:
        for event in events.failure(error):
            yield event
        return
    closing, response = events.finish(finish, usage)
    for event in closing:
        yield event
    await on_finished(response)
    yield events.last(response)
