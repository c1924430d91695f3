"""Cache-aware routing (gateway/routing.py), the pool's membership from dns: names, and failover in
gateway/calls.py against fake engines on loopback gRPC servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from gateway import calls
from gateway.config import GatewayConfig, parse_engine_addresses
from gateway.engines import EnginePool, resolve_addresses
from gateway.errors import APIError
from gateway.routing import CHUNK_BYTES, PrefixRecord, Router, RoutingConfig, input_bytes, prefix_hashes
from ladle.v1 import engine_pb2, types_pb2
from tests.unit.fake_engine import FakeEngine, start_fake_engine


@dataclass
class Candidate:
    busy: int = 0
    record: PrefixRecord = field(default_factory=PrefixRecord)


def chat(*contents: str, system: str = "") -> types_pb2.Input:
    value = types_pb2.Input()
    if system:
        value.chat.messages.add(role="system", content=system)
    for content in contents:
        value.chat.messages.add(role="user", content=content)
    return value


def hashes_of(value: types_pb2.Input) -> list[bytes]:
    return prefix_hashes(input_bytes(value))


LONG_SYSTEM = "You are a careful assistant for the accounts team. " * 40  # ~2 KB: eight chunks


def test_chained_hashes_share_a_prefix_and_only_a_prefix() -> None:
    a = hashes_of(chat("What is the balance?", system=LONG_SYSTEM))
    b = hashes_of(chat("Close the ledger, please.", system=LONG_SYSTEM))
    other = hashes_of(chat("What is the balance?", system=LONG_SYSTEM.replace("careful", "cheerful")))
    shared = len(LONG_SYSTEM) // CHUNK_BYTES
    assert a[:shared] == b[:shared] and len(a) >= shared
    assert not set(other) & set(a)  # one changed word early on changes every hash after it
    assert prefix_hashes(b"x" * (CHUNK_BYTES - 1)) == []  # no whole chunk: nothing to match
    ids = types_pb2.Input(token_ids=types_pb2.TokenIds(ids=list(range(200))))
    assert len(hashes_of(ids)) == 200 * 4 // CHUNK_BYTES


def test_a_conversation_that_grows_keeps_its_prefix() -> None:
    first = hashes_of(chat("Tell me about the quarterly report in detail. " * 10, system=LONG_SYSTEM))
    longer = chat("Tell me about the quarterly report in detail. " * 10, system=LONG_SYSTEM)
    longer.chat.messages.add(role="assistant", content="It went well.")
    longer.chat.messages.add(role="user", content="And the next one?")
    assert hashes_of(longer)[:len(first)] == first


def test_a_shared_prefix_goes_to_the_engine_that_served_it() -> None:
    router = Router()
    engines = [Candidate(), Candidate()]
    first = router.choose(engines, hashes_of(chat("q1", system=LONG_SYSTEM)))
    assert first.reason == "least_busy"
    for question in ("q2", "q3", "q4"):
        engines[first.index].busy += 1  # the prefix's engine gets a little busier: still preferred
        choice = router.choose(engines, hashes_of(chat(question, system=LONG_SYSTEM)))
        assert (choice.index, choice.reason) == (first.index, "prefix")
        assert choice.matched_chunks >= len(LONG_SYSTEM.encode()) // CHUNK_BYTES


def test_a_clearly_busier_prefix_engine_yields_to_the_least_busy() -> None:
    router = Router(RoutingConfig(balance_abs=4, balance_rel=1.5))
    engines = [Candidate(busy=0), Candidate(busy=0)]
    hashes = hashes_of(chat("q", system=LONG_SYSTEM))
    engines[0].record.add(hashes)
    engines[0].busy = 4  # 4 above the other: not more than balance_abs
    assert router.choose(engines, hashes).index == 0
    engines[0].busy, engines[1].busy = 20, 14  # 6 above, but not 1.5x
    assert router.choose(engines, hashes).index == 0
    engines[0].busy, engines[1].busy = 9, 2  # 7 above and 4.5x
    choice = router.choose(engines, hashes)
    assert (choice.index, choice.reason) == (1, "least_busy")
    assert engines[1].record.match(hashes) == len(hashes)  # now both engines hold it


def test_distinct_prompts_spread_evenly_and_least_busy_ignores_prefixes() -> None:
    router = Router()
    engines = [Candidate(), Candidate()]
    counts = [0, 0]
    for i in range(200):
        counts[router.choose(engines, hashes_of(chat(f"question {i}", system=f"{i} " + LONG_SYSTEM))).index] += 1
    assert counts == [100, 100]
    plain = Router(RoutingConfig(policy="least_busy"))
    hashes = hashes_of(chat("q", system=LONG_SYSTEM))
    engines[1].record.add(hashes)
    engines[0].busy = 0
    engines[1].busy = 1
    assert plain.choose(engines, hashes).index == 0


def test_the_record_forgets_the_oldest_and_a_prompts_tail_before_its_head() -> None:
    record = PrefixRecord(capacity=8)
    old = hashes_of(chat("old", system=LONG_SYSTEM))  # 8 chunks
    record.add(old)
    assert record.match(old) == len(old)
    new = hashes_of(chat("new", system="Another long system prompt. " * 40))
    record.add(new[:4])
    assert len(record) == 8
    assert record.match(old) == 4  # the head survives, the tail went first


def test_engine_addresses_parse_with_and_without_dns() -> None:
    assert parse_engine_addresses("a:1, dns:engines.svc:50051") == ("a:1", "dns:engines.svc:50051")
    for bad in ("", "dns:engines", "a:b"):
        with pytest.raises(ValueError):
            parse_engine_addresses(bad)


async def test_loopback_resolves_to_its_address() -> None:
    assert await resolve_addresses("127.0.0.1", 7) == ["127.0.0.1:7"]


async def test_dns_engines_join_and_leave_as_the_name_resolves() -> None:
    answers = [["10.0.0.1:50051", "10.0.0.2:50051"]]

    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("engines.svc", 50051)
        if isinstance(answers[0], OSError):
            raise answers[0]
        return answers[0]

    pool = EnginePool(GatewayConfig(engines=("dns:engines.svc:50051", "127.0.0.1:9"), resolve_interval_s=0.05,
                                    health_interval_s=60), resolve=resolve)
    assert pool.engines == []  # channels open in start(), on the running loop
    await pool.start()
    try:
        assert [e.address for e in pool.engines] == ["10.0.0.1:50051", "10.0.0.2:50051", "127.0.0.1:9"]
        answers[0] = ["10.0.0.2:50051", "10.0.0.3:50051"]
        await asyncio.sleep(0.3)
        assert [e.address for e in pool.engines] == ["10.0.0.2:50051", "127.0.0.1:9", "10.0.0.3:50051"]
        answers[0] = OSError("name resolution failed")  # type: ignore[list-item]
        await asyncio.sleep(0.3)
        assert len(pool.engines) == 3  # a failed lookup keeps what the last one gave
    finally:
        await pool.close()


@pytest.fixture
async def two_engines() -> AsyncIterator[tuple[EnginePool, FakeEngine, FakeEngine]]:
    first, second = FakeEngine(), FakeEngine()
    servers = [await start_fake_engine(fake) for fake in (first, second)]
    pool = EnginePool(GatewayConfig(engines=tuple(address for _, address in servers), health_interval_s=0.05,
                                    request_timeout_s=10))
    await pool.start()
    assert await pool.wait_ready(10)
    while len(pool.ready) < 2:
        await asyncio.sleep(0.05)
    yield pool, first, second
    await pool.close()
    for server, _ in servers:
        await server.stop(0)


def request(text: str) -> engine_pb2.GenerateRequest:
    """A prompt long enough to be routed by its prefix, so a test knows which engine it goes to first."""
    return engine_pb2.GenerateRequest(request_id=text, input=types_pb2.Input(text=text + " " * CHUNK_BYTES))


def fake_of(pool: EnginePool, fakes: tuple[FakeEngine, FakeEngine], address: str) -> FakeEngine:
    return fakes[[e.address for e in pool.engines].index(address)]


async def test_a_call_whose_engine_is_unavailable_is_sent_to_the_other_once(
    two_engines: tuple[EnginePool, FakeEngine, FakeEngine],
) -> None:
    pool, first, second = two_engines
    engine = pool.pick([request("hello").input])  # where "hello" goes first (and so is recorded)
    fake_of(pool, (first, second), engine.address).unavailable = True
    response = await calls.generate(pool, request("hello"))
    assert response.choices[0].text.strip() == "HELLO"
    assert pool.failovers == {engine.address: 1}
    first.unavailable = second.unavailable = True
    while len(pool.ready) < 2:
        await asyncio.sleep(0.05)
    with pytest.raises(APIError) as failed:  # both down: one retry, then the client's 503
        await calls.generate(pool, request("again"))
    assert failed.value.status == 503


async def test_a_stream_fails_over_before_output_and_ends_in_an_error_after_it(
    two_engines: tuple[EnginePool, FakeEngine, FakeEngine],
) -> None:
    pool, first, second = two_engines
    engine = pool.pick([request("stream me").input])
    fake = fake_of(pool, (first, second), engine.address)
    fake.unavailable = True
    texts = [m.choices[0].text async for m in calls.stream(pool, request("stream me"))]
    assert "".join(texts).strip() == "STREAM ME" and pool.failovers[engine.address] == 1
    while len(pool.ready) < 2:
        await asyncio.sleep(0.05)
    first.unavailable = second.unavailable = True
    first.unavailable_after_output = second.unavailable_after_output = True
    received = []
    with pytest.raises(APIError) as failed:
        async for message in calls.stream(pool, request("half way")):
            received.append(message.choices[0].text)
    assert received and "HALF WAY".startswith("".join(received).strip())  # the first chunk only
    assert failed.value.status == 503  # and no second engine once output was sent


async def test_a_batch_call_its_engine_refuses_is_sent_to_the_other_every_time(
    two_engines: tuple[EnginePool, FakeEngine, FakeEngine],
) -> None:
    """The engine refuses while the gateway is still sending the call's items: the refusal must still read
    UNAVAILABLE, not grpc.aio's INTERNAL (ladle.kept_status), for the call to go to the other engine."""
    pool, first, second = two_engines
    for attempt in range(20):
        requests = [request(f"round {attempt} line {i}") for i in range(8)]
        for engine in pool.engines:  # as the health poll finds them
            engine.serving = True
        target = pool.pick([requests[0].input])  # where the call goes first (and so is recorded)
        for fake in (first, second):
            fake.unavailable = fake is fake_of(pool, (first, second), target.address)
        results = await calls.batch_rpc(pool, requests, "messages")
        assert [r.choices[0].text.strip() for r in results] == [f"ROUND {attempt} LINE {i}" for i in range(8)]
    assert sum(pool.failovers.values()) == 20


async def test_an_error_other_than_unavailable_is_not_retried(
    two_engines: tuple[EnginePool, FakeEngine, FakeEngine],
) -> None:
    pool, first, second = two_engines
    requests = [request("bad")]
    first.invalid = second.invalid = {requests[0].input.text}
    with pytest.raises(APIError) as failed:
        await calls.batch_rpc(pool, requests, "messages")
    assert failed.value.status == 400 and first.calls + second.calls == 1


def test_a_chats_images_and_clips_are_routed_by_their_digests() -> None:
    """A turn's image and audio bytes count as one chunk each (`clip_key`): a 4 MiB image costs one hash, the same
    image routes alike and another does not, and a conversation that extends the turn extends its bytes."""
    from gateway.routing import clip_key

    def turn(image: bytes, clip: bytes) -> types_pb2.ChatMessage:
        return types_pb2.ChatMessage(role="user", content_parts=[
            types_pb2.ContentPart(text="What is this?"), types_pb2.ContentPart(image=types_pb2.Image(data=image)),
            types_pb2.ContentPart(audio=types_pb2.Audio(data=clip))])  # fmt: skip

    def chat(*messages: types_pb2.ChatMessage) -> bytes:
        return input_bytes(types_pb2.Input(chat=types_pb2.ChatInput(messages=list(messages))))

    big, other, clip = b"\x89PNG" + bytes(4 * 2**20), b"\x89PNG" + bytes(2**20), b"RIFF" + bytes(2**20)
    keyed = chat(turn(big, clip))
    assert len(keyed) < 3 * CHUNK_BYTES and clip_key(big) in keyed and clip_key(clip) in keyed
    assert keyed == chat(turn(big, clip)) and keyed != chat(turn(other, clip))
    longer = chat(turn(big, clip), types_pb2.ChatMessage(role="assistant", content="A cat."))
    assert longer.startswith(keyed) and len(prefix_hashes(longer)) >= len(prefix_hashes(keyed))
    plain = types_pb2.ChatMessage(role="user", content="hello")
    assert chat(plain) == plain.SerializeToString(deterministic=True)
