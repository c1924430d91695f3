"""Many concurrent streams, some malformed, through the asyncio client: every good stream completes correctly."""

from __future__ import annotations

import asyncio

import grpc

from ladle.client import AsyncEngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess
from tests.e2e.helpers import generate, joined_stream, stream

PROMPTS = [
    "The capital of France is",
    "My favourite fruit is",
    "The quick brown fox",
    "In the beginning",
    "Water boils at",
    "The best way to learn is",
    "Once upon a time",
    "The sun rises in the",
]
NUM_STREAMS = 100
MAX_TOKENS = 8


def _malformed(i: int) -> engine_pb2.StreamRequest:
    kinds = [
        stream("bad", MAX_TOKENS, top_p=0.0),
        stream("", MAX_TOKENS),
        engine_pb2.StreamRequest(input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[1, 10**6]))),
        stream("bad", 10**5),
        engine_pb2.StreamRequest(),
    ]
    return kinds[i % len(kinds)]


async def test_100_concurrent_streams_with_malformed_ones(engine: EngineProcess) -> None:
    async with AsyncEngineClient(engine.address, timeout=240) as client:
        expected = {
            p: (await client.generate(generate(p, MAX_TOKENS, ignore_eos=True))).choices[0] for p in PROMPTS
        }

        async def good(i: int) -> tuple[str, list[engine_pb2.StreamResponse]]:
            prompt = PROMPTS[i % len(PROMPTS)]
            return prompt, [r async for r in client.stream(stream(prompt, MAX_TOKENS, ignore_eos=True))]

        async def bad(i: int) -> grpc.StatusCode:
            try:
                async for _ in client.stream(_malformed(i)):
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        # Every fourth call is malformed; all start together.
        calls = [bad(i) if i % 4 == 3 else good(i) for i in range(NUM_STREAMS)]
        outcomes = await asyncio.gather(*calls)

    goods = [o for o in outcomes if isinstance(o, tuple)]
    bads = [o for o in outcomes if not isinstance(o, tuple)]
    assert len(goods) == 75 and len(bads) == 25
    assert set(bads) == {grpc.StatusCode.INVALID_ARGUMENT}
    for prompt, responses in goods:
        text, ids, finish = joined_stream(responses)[0]
        assert (text, ids) == (expected[prompt].text, list(expected[prompt].token_ids)), prompt
        assert finish == types_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == MAX_TOKENS
