"""Prefix-cache isolation in the gateway: the salt of a project (and of a body's `cache_salt`), that every engine
request built from an HTTP request or a batch line carries it, and that routing's prefix hashes are salted alike.
The engine's side (block hashes seeded by the salt) is tests/unit/test_kv_cache_manager.py; the whole path, with
cached_tokens and TTFT, tests/e2e/test_cache_isolation.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest

from gateway import calls
from gateway.batches.lines import engine_requests, parse_line
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.routing import CHUNK_BYTES, PrefixRecord, Router, input_bytes, prefix_hashes
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.completions import CompletionRequest
from gateway.translate import to_engine
from gateway.translate.cache_salt import project_cache_salt, request_cache_salt
from ladle.v1 import engine_pb2, types_pb2
from tests.unit.fake_engine import MODEL, FakeEngine, gateway_client, start_fake_engine

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
ALPHA, BETA = project_cache_salt("alpha"), project_cache_salt("beta")


def test_each_project_has_its_own_stable_salt_and_a_body_salt_narrows_it() -> None:
    assert project_cache_salt("alpha") == ALPHA != BETA and len(ALPHA) == 64
    assert request_cache_salt(ALPHA, None) == ALPHA
    per_user = request_cache_salt(ALPHA, "user-1")
    assert per_user not in {ALPHA, BETA, request_cache_salt(ALPHA, "user-2"), request_cache_salt(BETA, "user-1")}
    # A body salt is hashed with the project's: beta naming alpha's salt (or anything else) never gets it.
    assert request_cache_salt(BETA, ALPHA) != ALPHA
    # Length-prefixed parts: moving characters between project and body salt changes the result.
    assert request_cache_salt(project_cache_salt("ab"), "c") != request_cache_salt(project_cache_salt("a"), "bc")
    assert request_cache_salt(ALPHA, "\ud800")  # a lone surrogate from JSON still hashes


def test_the_body_cache_salt_is_vllms_optional_non_empty_string() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": messages}).cache_salt is None
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "cache_salt": "u"}).cache_salt
    for bad in ("", 5, ["u"]):
        with pytest.raises(pydantic.ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "cache_salt": bad})
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p", "cache_salt": "u"}).cache_salt == "u"


def test_translated_requests_carry_the_project_salt_combined_with_the_body_salt() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert to_engine.chat_request(chat, chat.messages, "r", cache_salt=ALPHA).cache_salt == ALPHA
    chat.cache_salt = "user-1"
    assert to_engine.chat_request(chat, chat.messages, "r", cache_salt=ALPHA).cache_salt == request_cache_salt(
        ALPHA, "user-1")
    completion = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "cache_salt": "user-1"})
    salts = {r.cache_salt for r in to_engine.completion_requests(completion, "r", cache_salt=BETA)}
    assert salts == {request_cache_salt(BETA, "user-1")}


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/embeddings", {"input": ["a", "b"]}),
        ("/v1/score", {"text_1": ["q1", "q2"], "text_2": ["d1", "d2"]}),
        ("/v1/rerank", {"query": "q", "documents": ["d1", "d2"]}),
    ],
)
def test_every_batch_line_kind_carries_the_batch_projects_salt(url: str, body: dict[str, Any]) -> None:
    raw = json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": {"model": "m", **body}}).encode()
    line = parse_line(raw, 1, 0, url, None)
    requests = engine_requests(line, "b-1", cache_salt=ALPHA)
    assert requests and all(r.cache_salt == ALPHA for r in requests)
    assert all(r.cache_salt == "" for r in engine_requests(line, "b-1"))  # the keyword's default: no salt


def test_a_batch_lines_body_salt_is_combined_as_the_routes_combine_it() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "user-1"}
    raw = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()
    line = parse_line(raw, 1, 0, None, None)
    assert [r.cache_salt for r in engine_requests(line, "b-1", cache_salt=ALPHA)] == [request_cache_salt(
        ALPHA, "user-1")]


# -- routing -----------------------------------------------------------------------------------------------------


PROMPT = types_pb2.Input(text="A long shared system prompt for the accounts team. " * 40)


def test_routing_hashes_are_salted_as_the_engines_blocks_are() -> None:
    plain = prefix_hashes(input_bytes(PROMPT))
    assert prefix_hashes(input_bytes(PROMPT), cache_salt="") == plain  # no salt: the hashes as they were
    alpha, beta = (prefix_hashes(input_bytes(PROMPT), cache_salt=s) for s in (ALPHA, BETA))
    assert alpha == prefix_hashes(input_bytes(PROMPT), cache_salt=ALPHA) and len(alpha) == len(plain)
    assert not set(alpha) & set(beta) and not set(alpha) & set(plain)


@dataclass
class Candidate:
    busy: int = 0
    record: PrefixRecord = field(default_factory=PrefixRecord)


def test_a_projects_prefix_draws_its_own_requests_and_not_anothers() -> None:
    router = Router()
    engines = [Candidate(), Candidate()]
    alpha = prefix_hashes(input_bytes(PROMPT), cache_salt=ALPHA)
    first = router.choose(engines, alpha)
    engines[first.index].busy += 1  # a little busier: alpha's own prefix still wins
    again = router.choose(engines, alpha)
    assert (again.index, again.reason) == (first.index, "prefix")
    assert again.matched_chunks == len(input_bytes(PROMPT)) // CHUNK_BYTES
    engines[first.index].busy += 1
    beta = router.choose(engines, prefix_hashes(input_bytes(PROMPT), cache_salt=BETA))
    assert (beta.index, beta.reason) == (1 - first.index, "least_busy")  # no pull toward alpha's engine


async def test_the_pool_routes_a_call_by_its_salted_prefix() -> None:
    """Through `calls`: a project's repeat goes where its prefix went; another project's same prompt matches no
    prefix (it could not hit one) and goes to the least busy engine."""
    engines = [SaltRecordingEngine(), SaltRecordingEngine()]
    servers = [await start_fake_engine(engine) for engine in engines]
    pool = EnginePool(GatewayConfig(engines=tuple(address for _, address in servers), health_interval_s=0.05))
    await pool.start()
    try:
        while len(pool.ready) < 2:
            await asyncio.sleep(0.05)
        for salt in (ALPHA, ALPHA, BETA):
            await calls.generate(pool, engine_pb2.GenerateRequest(input=PROMPT, cache_salt=salt))
        reasons = sorted(reason for (_, reason), count in pool.routed.items() for _ in range(count))
        assert reasons == ["least_busy", "least_busy", "prefix"]  # beta's call matched no prefix
        assert sorted(engines[0].salts + engines[1].salts) == sorted([ALPHA, ALPHA, BETA])
    finally:
        await pool.close()
        for server, _ in servers:
            await server.stop(None)


# -- the routes against a fake engine that records the salts it receives -----------------------------------------


@dataclass
class SaltRecordingEngine(FakeEngine):
    salts: list[str] = field(default_factory=list)  # the cache_salt of every request received, in order

    async def Generate(self, request: engine_pb2.GenerateRequest, context: Any) -> engine_pb2.GenerateResponse:
        self.salts.append(request.cache_salt)
        return await super().Generate(request, context)

    async def Stream(self, request: engine_pb2.StreamRequest, context: Any) -> AsyncIterator[
            engine_pb2.StreamResponse]:
        self.salts.append(request.cache_salt)
        async for message in super().Stream(request, context):
            yield message

    async def Embed(self, request: engine_pb2.EmbedRequest, context: Any) -> engine_pb2.EmbedResponse:
        self.salts.append(request.cache_salt)
        return await super().Embed(request, context)

    async def Score(self, request: engine_pb2.ScoreRequest, context: Any) -> engine_pb2.ScoreResponse:
        self.salts.append(request.cache_salt)
        return await super().Score(request, context)

    async def Batch(self, request_iterator: AsyncIterator[engine_pb2.BatchRequest], context: Any) -> AsyncIterator[
            engine_pb2.BatchResponse]:
        async def recorded() -> AsyncIterator[engine_pb2.BatchRequest]:
            async for item in request_iterator:
                self.salts.append(item.request.cache_salt)
                yield item

        async for response in super().Batch(recorded(), context):
            yield response


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, SaltRecordingEngine]]:
    engine = SaltRecordingEngine()
    server, address = await start_fake_engine(engine)
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{key} {project}\n" for key, project in KEYS.items()))
    async with gateway_client(address, tmp_path, api_keys_file=keys) as client:
        yield client, engine
    await server.stop(None)


TWO_CHATS = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/completions", {"prompt": ["a", "b"], "stream": True}),
    ("/v1/chat/completions/batch", {"messages": TWO_CHATS}),
    ("/v1/embeddings", {"input": ["a", "b"]}),
    ("/v1/score", {"text_1": ["q1", "q2"], "text_2": ["d1", "d2"]}),
    ("/v1/rerank", {"query": "q", "documents": ["d1", "d2"]}),
]


@pytest.mark.parametrize(("url", "body"), ROUTES)
async def test_every_route_sends_its_keys_project_salt(
    gateway: tuple[httpx.AsyncClient, SaltRecordingEngine], url: str, body: dict[str, Any]
) -> None:
    http, engine = gateway
    for key, salt in (("sk-alpha", ALPHA), ("sk-beta", BETA)):
        engine.salts.clear()
        response = await http.post(url, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        assert engine.salts and set(engine.salts) == {salt}, (url, key)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_body_salt_is_combined_with_the_keys_project(
    gateway: tuple[httpx.AsyncClient, SaltRecordingEngine], stream: bool
) -> None:
    http, engine = gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": ALPHA, "stream": stream}
    response = await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-beta"})
    assert response.status_code == 200, response.text
    assert engine.salts == [request_cache_salt(BETA, ALPHA)]  # naming alpha's salt does not reach alpha's cache
    refused = await http.post("/v1/chat/completions", json={**body, "cache_salt": ""},
                              headers={"Authorization": "Bearer sk-beta"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt", refused.text
