"""Engine streams -> OpenAI chunk dicts for chat and completions, and events for transcriptions (encoded as SSE
by `gateway.sse`).

Per choice, chat sends a role chunk first, then content chunks, then a chunk holding only the finish reason;
completions sends text chunks and then the finish chunk. With `stream_options.include_usage`, every chunk has
`"usage": null` and one last chunk with no choices carries the totals, as OpenAI does. With vLLM's
`return_token_ids`, the prompt's token ids ride on the first chunk (chat: on the chunk; completions: on each
choice's first) and each engine delta's new token ids on the first chunk choice made of it (an empty delta where it
made none, so the chunks' `token_ids` joined are every generated token).

However a stream ends (finished, failed, or its client gone), its request's usage is counted once
(`RequestTimer.finish`): each engine stream's `usage`, or for one that did not finish, what its last message said it
had used so far (`usage_so_far`), so a client that leaves early is billed for what it was sent and its rate-limit
reservation is settled.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.deps import RequestTimer
from gateway.translate import from_engine, transcriptions
from ladle.v1 import engine_pb2, types_pb2


@dataclass(frozen=True)
class StreamHeader:
    """What every chunk of one response repeats."""

    response_id: str
    object: str  # "chat.completion.chunk" or "text_completion"
    model: str
    include_usage: bool
    created: int = 0

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.response_id, "object": self.object, "created": self.created or int(time.time()),
            "model": self.model, "system_fingerprint": None, "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: list[types_pb2.Usage]) -> dict[str, Any]:
        body = self.chunk([])
        body["usage"] = from_engine.usage(usage)
        return body


async def chat_chunks(
    messages: AsyncIterator[engine_pb2.StreamResponse], header: StreamHeader, want_logprobs: bool,
    timer: RequestTimer, first_call_only: bool = False, want_token_ids: bool = False, as_ids: bool = False,
    echo: str = "",
) -> AsyncIterator[dict[str, Any]]:
    """Each choice's role, content, tool call and finish chunks; with `first_call_only`
    (`from_engine.one_call`), only each choice's first tool call; with `want_token_ids`, the token ids; `as_ids`:
    the logprobs' tokens by id (`from_engine.token_label`); `echo` (vLLM's), a content chunk of its own after each
    choice's role chunk."""
    started: set[int] = set()
    used = types_pb2.Usage()
    prompt_ids: list[int] | None = None  # the first chunk's, once the first message has them
    try:
        async for message in messages:
            timer.token()
            used = from_engine.used(message)
            if want_token_ids and not started and prompt_ids is None:
                prompt_ids = list(message.prompt_token_ids)
            for delta in message.choices:
                choices = []
                if delta.index not in started:
                    started.add(delta.index)
                    choices.append(from_engine.role_delta(delta.index))
                    if echo:
                        choices.append({"index": delta.index, "delta": {"content": echo}, "logprobs": None,
                                        "finish_reason": None})  # fmt: skip
                made = from_engine.chat_deltas(delta, want_logprobs, first_call_only, as_ids)
                if delta.finish_reason:
                    made.append(from_engine.finish_delta(delta, delta.index, chat=True))
                if want_token_ids and delta.token_ids:
                    made = made or [{"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": None}]
                    made[0]["token_ids"] = list(delta.token_ids)
                for choice in [*choices, *made]:
                    chunk = header.chunk([choice])
                    if prompt_ids is not None:  # the first chunk's alone
                        chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
                    yield chunk
    finally:
        timer.finish([used])
    if header.include_usage:
        yield header.usage_chunk([used])


async def completion_chunks(
    messages: AsyncIterator[tuple[int, engine_pb2.StreamResponse]], header: StreamHeader, n: int,
    want_logprobs: bool, echo: Callable[[int, engine_pb2.StreamResponse], from_engine.Echo] | None,
    timer: RequestTimer, prompt_only: bool = False, want_token_ids: bool = False, as_ids: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """`messages` are (prompt position, engine message) pairs; choice i of prompt p has index p * n + i. `echo`
    (None: no echo) gives what prompt p echoes, from its engine stream's first message (its prompt logprobs).
    `prompt_only` (max_tokens 0): the echo and the finish alone; the engine's token is neither sent nor counted.
    `want_token_ids`: each choice's first chunk has its prompt's ids, its chunks the new generated ones. `as_ids`: the
    logprobs' tokens by id (the echo's are `echo`'s)."""
    offsets: dict[int, int] = {}
    echoes: dict[int, from_engine.Echo] = {}
    used: dict[int, types_pb2.Usage] = {}  # per prompt (each its own engine stream)
    prompt_ids: dict[int, list[int]] = {}  # per prompt, from its engine stream's first message
    opened: set[int] = set()  # the choices whose first chunk has been sent
    try:
        async for prompt_index, message in messages:
            timer.token()
            used[prompt_index] = from_engine.used(message)
            if prompt_only:
                used[prompt_index] = from_engine.input_only(used[prompt_index])
            if echo is not None and prompt_index not in echoes:
                echoes[prompt_index] = echo(prompt_index, message)
            if want_token_ids and prompt_index not in prompt_ids:
                prompt_ids[prompt_index] = list(message.prompt_token_ids)
            for delta in message.choices:
                index = prompt_index * n + delta.index
                choices = []
                if index not in offsets and echo is not None:
                    echoed = echoes[prompt_index]
                    offsets[index] = len(echoed.text)
                    choices.append({"index": index, "text": echoed.text, "logprobs": echoed.logprobs,
                                    "finish_reason": None})  # fmt: skip
                offset = offsets.setdefault(index, 0)
                new_ids = list(delta.token_ids) if want_token_ids and not prompt_only else []
                if (from_engine.has_content(delta) or new_ids) and not prompt_only:
                    choices.append(from_engine.completion_delta(delta, index, want_logprobs, offset, as_ids))
                    offsets[index] = offset + len(delta.text)
                    if new_ids:
                        choices[-1]["token_ids"] = new_ids
                if delta.finish_reason:
                    choices.append(from_engine.finish_delta(delta, index, chat=False))
                if want_token_ids and choices and index not in opened:
                    choices[0]["prompt_token_ids"] = prompt_ids[prompt_index]
                opened.update([index] if choices else [])
                for choice in choices:
                    yield header.chunk([choice])
    finally:
        timer.finish(used.values())
    if header.include_usage:
        yield header.usage_chunk(list(used.values()))


async def transcript_events(
    messages: AsyncIterator[engine_pb2.StreamResponse], timer: RequestTimer, want_logprobs: bool
) -> AsyncIterator[dict[str, Any]]:
    """A transcription's stream as OpenAI sends it: a `transcript.text.delta` event per engine message with new
    text (the leading white space of the text trimmed, as the whole text's is), then `transcript.text.done` with
    the whole text and the usage (and, with `want_logprobs`, every token's logprob on each)."""
    used = types_pb2.Usage()
    parts: list[str] = []
    entries: list[dict[str, Any]] = []
    try:
        async for message in messages:
            timer.token()
            used = from_engine.used(message)
            for delta in message.choices[:1]:
                text = delta.text if any(parts) else delta.text.lstrip()
                parts.append(text)
                event = transcriptions.delta_event(text, delta.logprobs, want_logprobs)
                entries += event.get("logprobs", [])
                if text or event.get("logprobs"):
                    yield event
    finally:
        timer.finish([used])
    yield transcriptions.done_event("".join(parts), used, entries if want_logprobs else None)
