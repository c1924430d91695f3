"""A streamed request is counted once however its stream ends: finished, failed, or left by its client. Chat,
completions and Responses streams count each engine stream's `usage`, or for one that did not finish, its last
`usage_so_far`; the rate-limit reservation is settled to that (the real limiter, SQLite and PostgreSQL). The same
against the real engine and a client that hangs up: tests/e2e/test_usage_serving.py."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from gateway.config import GatewayConfig
from gateway.deps import RequestTimer
from gateway.engines import EnginePool
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.rate_limits import RateLimiter, RateLimits
from gateway.responses.events import ResponseEvents, response_events
from gateway.schemas.responses import ResponsesRequest
from gateway.store.rate_windows import RateWindowStore
from gateway.store.usage import UsageCounts, UsageStore
from gateway.streaming import StreamHeader, chat_chunks, completion_chunks
from gateway.translate import responses_from_engine
from ladle.v1 import engine_pb2, types_pb2

MINUTE = 1_800_000_000 // 60 * 60
PROMPT = 6  # prompt tokens of every engine stream here


def message(text: str, so_far: int, last: bool = False) -> engine_pb2.StreamResponse:
    """An engine stream message as the engine sends it: `so_far` tokens generated up to it."""
    used = types_pb2.Usage(prompt_tokens=PROMPT, completion_tokens=so_far, total_tokens=PROMPT + so_far,
                           cached_prompt_tokens=2)
    finish = types_pb2.FINISH_REASON_LENGTH if last else types_pb2.FINISH_REASON_UNSPECIFIED
    reply = engine_pb2.StreamResponse(request_id="r", model="m", usage_so_far=used, choices=[
        types_pb2.ChoiceDelta(index=0, text=text, token_ids=[so_far], finish_reason=finish)])
    if last:
        reply.usage.CopyFrom(used)
    return reply


MESSAGES = [message("a", 1), message("b", 2), message("c", 3, last=True)]


async def engine_stream(messages: Iterable[engine_pb2.StreamResponse], fail_after: int | None = None
                        ) -> AsyncIterator[engine_pb2.StreamResponse]:
    for i, reply in enumerate(messages):
        if i == fail_after:
            raise APIError(503, "the engine went away", type="server_error")
        yield reply


def timer(project: str = "alpha", admission: Any = None) -> tuple[RequestTimer, GatewayMetrics]:
    metrics = GatewayMetrics(EnginePool(GatewayConfig(engines=("127.0.0.1:1",))))
    return RequestTimer(metrics, "/v1/chat/completions", project, "m", admission), metrics


def counted(metrics: GatewayMetrics) -> UsageCounts:
    (counts,) = metrics.usage.take().values()
    return counts


async def read(chunks: AsyncIterator[Any], count: int) -> None:
    """Take `count` items, then hang up as a client does (the stream is closed)."""
    for _ in range(count):
        await anext(chunks)
    await chunks.aclose()  # type: ignore[attr-defined]


def test_a_chat_stream_left_early_counts_what_was_generated_up_to_its_last_message() -> None:
    request_timer, metrics = timer()
    header = StreamHeader("chatcmpl-1", "chat.completion.chunk", "m", include_usage=True)
    chunks = chat_chunks(engine_stream(MESSAGES), header, False, request_timer)
    asyncio.run(read(chunks, 3))  # the role chunk, "a", "b": the engine had sent two messages
    assert counted(metrics) == UsageCounts(requests=1, input_tokens=PROMPT, cached_tokens=2, output_tokens=2)


def test_a_finished_chat_stream_counts_its_usage_once() -> None:
    request_timer, metrics = timer()
    header = StreamHeader("chatcmpl-1", "chat.completion.chunk", "m", include_usage=True)

    async def run() -> list[dict[str, Any]]:
        return [chunk async for chunk in chat_chunks(engine_stream(MESSAGES), header, False, request_timer)]

    chunks = asyncio.run(run())
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["usage"]["prompt_tokens"] == PROMPT
    assert counted(metrics) == UsageCounts(requests=1, input_tokens=PROMPT, cached_tokens=2, output_tokens=3)


def test_a_chat_stream_that_fails_counts_what_its_engine_sent() -> None:
    request_timer, metrics = timer()
    header = StreamHeader("chatcmpl-1", "chat.completion.chunk", "m", include_usage=False)

    async def run() -> None:
        async for _ in chat_chunks(engine_stream(MESSAGES, fail_after=2), header, False, request_timer):
            pass

    with pytest.raises(APIError):
        asyncio.run(run())
    assert counted(metrics).output_tokens == 2


def test_a_completions_stream_left_early_counts_each_prompts_engine_stream() -> None:
    request_timer, metrics = timer()
    header = StreamHeader("cmpl-1", "text_completion", "m", include_usage=False)

    async def merged() -> AsyncIterator[tuple[int, engine_pb2.StreamResponse]]:
        for prompt, reply in [(0, MESSAGES[0]), (1, MESSAGES[0]), (0, MESSAGES[1]), (0, MESSAGES[2]),
                              (1, MESSAGES[1])]:
            yield prompt, reply

    asyncio.run(read(completion_chunks(merged(), header, 1, False, None, request_timer), 4))
    # prompt 0 finished (3 tokens); prompt 1 had sent one message when the client left
    assert counted(metrics) == UsageCounts(requests=1, input_tokens=2 * PROMPT, cached_tokens=4, output_tokens=4)


def test_a_responses_stream_left_early_is_counted_and_not_stored() -> None:
    request_timer, metrics = timer()
    shell = responses_from_engine.response_shell(ResponsesRequest(model="m", input="x"), "resp_1", "m",
                                                 "in_progress")
    stored: list[dict[str, Any]] = []

    async def on_finished(response: dict[str, Any]) -> None:
        stored.append(response)

    events = response_events(engine_stream(MESSAGES), ResponseEvents(shell, False), on_finished,
                             request_timer.token, lambda usage: request_timer.finish([usage]))
    # created, in_progress, the item and its part added, the first delta: the engine had sent one message
    asyncio.run(read(events, 5))
    assert counted(metrics) == UsageCounts(requests=1, input_tokens=PROMPT, cached_tokens=2, output_tokens=1)
    assert stored == []


def test_a_stream_left_early_settles_its_rate_limit_reservation(store_db: Engine, tmp_path: Path) -> None:
    path = tmp_path / "limits"
    path.write_text("alpha tokens_per_minute=3000\n")
    limiter = RateLimiter(RateLimits(path), clock=lambda: MINUTE + 30.0)
    limiter.open(RateWindowStore(store_db), UsageStore(store_db))

    async def run() -> str:
        state = types.SimpleNamespace()
        admission = await limiter.admit(state, "alpha", 400, 100)  # reserves 400 / 4 + 100 = 200 tokens
        assert admission is not None and admission.reserved == 200
        request_timer, _ = timer(admission=admission)
        header = StreamHeader("chatcmpl-1", "chat.completion.chunk", "m", include_usage=False)
        await read(chat_chunks(engine_stream(MESSAGES), header, False, request_timer), 2)  # role, "a"
        await asyncio.sleep(0.2)  # the correction runs in the background
        await limiter.admit(state, "alpha", 0, 10)
        remaining: str = state.ratelimit_headers["x-ratelimit-remaining-tokens"]
        return remaining

    # the left stream holds what it used (6 prompt + 1 generated), not its 200 reserved
    assert asyncio.run(run()) == str(3000 - (PROMPT + 1) - 10)
