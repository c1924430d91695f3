"""Embeddings, score and rerank in the gateway: the pure conversions of their bodies into Embed / Score requests and
of the replies into OpenAI's and vLLM's JSON, the routes against the fake engine (the openai SDK's float and base64
embeddings included), and batch lines for the three endpoints through the line runner."""

from __future__ import annotations

import array
import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import ValidationError

from gateway import calls
from gateway.batches import lines
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.errors import APIError, validation_param
from gateway.schemas.pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from gateway.translate import pooling_from_engine, pooling_to_engine
from ladle.v1 import engine_pb2, types_pb2
from tests.unit.fake_engine import (
    DIMENSIONS,
    MODEL,
    FakeEngine,
    fake_score,
    fake_vector,
    gateway_client,
    start_fake_engine,
)

INFO = engine_pb2.GetModelInfoResponse(context_length=128, pooling=engine_pb2.PoolingInfo(dimensions=8))


def embedding(**fields: Any) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate({"model": "m", **fields})


def score(**fields: Any) -> ScoreRequest:
    return ScoreRequest.model_validate(fields)


def refused(build: Any) -> APIError:
    with pytest.raises(APIError) as raised:
        build()
    assert raised.value.status == 400
    return raised.value


def text(value: str) -> types_pb2.Input:
    return types_pb2.Input(text=value)


# -- conversions -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "kinds"), [
    ("hi", ["text"]),
    (["a", "b"], ["text", "text"]),
    ([1, 2, 3], ["token_ids"]),
    ([[1, 2], [3]], ["token_ids", "token_ids"]),
])
def test_openais_four_input_forms_become_one_engine_input_each(value: Any, kinds: list[str]) -> None:
    request = pooling_to_engine.embed_request(embedding(input=value), "r", INFO)
    assert [i.WhichOneof("kind") for i in request.inputs] == kinds
    assert request.request_id == "r"
    for name in ("dimensions", "normalize", "truncate_prompt_tokens"):  # the model's defaults apply
        assert not request.HasField(name)


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[1], []]}, "input[1]"),
    ({"input": [5, -1]}, "input"),
    ({"input": [[5], [-1]]}, "input[1]"),
    ({}, "input"),
    ({"input": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"input": "a", "add_special_tokens": False}, "add_special_tokens"),
    ({"input": "a", "dimensions": 9}, "dimensions"),  # more than the model's 8
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": ["a"] * 2049}, "input"),
])
def test_what_an_embed_request_cannot_be_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(lambda: pooling_to_engine.embed_request(embedding(**fields), "r", INFO)).param == param


def test_a_chat_embedding_may_continue_its_last_message() -> None:
    """vLLM's continue_final_message on a chat embedding: the engine renders the conversation cut after the last
    message's content (`render_chat`)."""
    messages = [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    request = pooling_to_engine.embed_request(embedding(messages=messages, continue_final_message=True), "r", INFO)
    chat = request.inputs[0].chat
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": "a", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_types_are_refused_by_the_schema(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as raised:
        embedding(**fields)
    assert validation_param(tuple(raised.value.errors()[0]["loc"])) == param


@pytest.mark.parametrize(("schema", "fields", "param"), [
    (ScoreRequest, {"text_1": 5, "text_2": "a"}, "text_1"),
    (ScoreRequest, {"text_1": "q", "documents": [["a"]]}, "documents"),
    (RerankRequest, {"query": "q", "documents": [1]}, "documents"),
    (RerankRequest, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
])
def test_bad_score_and_rerank_types_name_the_field(schema: Any, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as raised:
        schema.model_validate(fields)
    assert validation_param(tuple(raised.value.errors()[0]["loc"])) == param


def test_text_that_is_not_unicode_is_a_400_not_a_protobuf_error() -> None:
    assert refused(lambda: pooling_to_engine.embed_request(embedding(input=["a", "b\ud800"]), "r")).status == 400
    not_unicode = embedding(messages=[{"role": "user", "content": "\udfff"}])
    assert refused(lambda: pooling_to_engine.embed_request(not_unicode, "r"))
    assert refused(lambda: pooling_to_engine.score_requests(score(text_1="\ud800", text_2="a"), "r"))
    bad = RerankRequest.model_validate({"query": "q", "documents": [{"text": "\ud800"}]})
    assert refused(lambda: pooling_to_engine.rerank_request(bad, "r"))


def test_embed_options_are_carried() -> None:
    request = pooling_to_engine.embed_request(
        embedding(input="a", dimensions=4, normalize=False, truncate_prompt_tokens=7), "r", INFO)
    assert (request.dimensions, request.normalize, request.truncate_prompt_tokens) == (4, False, 7)
    assert pooling_to_engine.embed_request(embedding(input="a", use_activation=True), "r").normalize is True
    whole = pooling_to_engine.embed_request(embedding(input="a", truncate_prompt_tokens=-1), "r", INFO)
    assert whole.truncate_prompt_tokens == 128  # vLLM's -1: the context length
    unknown = pooling_to_engine.embed_request(embedding(input="a", truncate_prompt_tokens=-1, dimensions=4096), "r")
    assert not unknown.HasField("truncate_prompt_tokens") and unknown.dimensions == 4096  # the engine checks


def test_a_chat_embedding_is_one_chat_input_without_the_generation_prompt() -> None:
    body = embedding(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                     chat_template_kwargs={"enable_thinking": False})
    [value] = pooling_to_engine.embed_request(body, "r", INFO).inputs
    assert [m.content for m in value.chat.messages] == ["s", "u"]
    assert value.chat.add_generation_prompt is False and "enable_thinking" in value.chat.chat_template_kwargs_json


@pytest.mark.parametrize(("fields", "queries", "documents"), [
    ({"text_1": "q", "text_2": ["a", "b"]}, ["q", "q"], ["a", "b"]),
    ({"text_1": ["q"], "text_2": "a"}, ["q"], ["a"]),
    ({"text_1": ["q1", "q2", "q1"], "text_2": ["a", "b", "c"]}, ["q1", "q2", "q1"], ["a", "b", "c"]),
    ({"queries": "q", "documents": ["a"]}, ["q"], ["a"]),
    ({"queries": "q", "items": ["a"]}, ["q"], ["a"]),
    ({"data_1": "q", "data_2": "a"}, ["q"], ["a"]),
])
def test_score_pairs_one_against_n_or_n_against_n(fields: dict[str, Any], queries: list[str],
                                                  documents: list[str]) -> None:
    assert pooling_to_engine.score_pairs(score(**fields))[:2] == (queries, documents)


def test_score_calls_group_pairs_by_equal_query() -> None:
    body = score(text_1=["q1", "q2", "q1"], text_2=["a", "b", "c"], truncate_prompt_tokens=-1)
    requests = pooling_to_engine.score_requests(body, "r", INFO)
    assert [(r.request_id, r.query.text, [d.text for d in r.documents]) for r in requests] == [
        ("r-0", "q1", ["a", "c"]), ("r-1", "q2", ["b"])]
    assert all(r.truncate_prompt_tokens == 128 for r in requests)
    assert pooling_to_engine.score_groups(["q1", "q2", "q1"]) == [[0, 2], [1]]
    replies = [engine_pb2.ScoreResponse(scores=[0.5, 0.25]), engine_pb2.ScoreResponse(scores=[-0.5])]
    for reply in replies:
        reply.usage.prompt_tokens = 3
    out = pooling_from_engine.score_list([[0, 2], [1]], replies, "score-r", "m")
    assert [(d["index"], d["object"], d["score"]) for d in out["data"]] == [
        (0, "score", 0.5), (1, "score", -0.5), (2, "score", 0.25)]
    assert out["object"] == "list" and out["usage"] == {"prompt_tokens": 6, "total_tokens": 6,
                                                        "completion_tokens": 0}


@pytest.mark.parametrize(("fields", "param"), [
    ({}, "text_1"),
    ({"text_1": "q"}, "text_1"),
    ({"text_1": "q", "text_2": "a", "queries": "q", "documents": "a"}, "text_1"),
    ({"text_1": ["q1", "q2"], "text_2": ["a", "b", "c"]}, "text_2"),
    ({"text_1": [], "text_2": ["a"]}, "text_1"),
    ({"text_1": "q", "text_2": ["a", ""]}, "text_2[1]"),
    ({"text_1": "", "text_2": "a"}, "text_1"),
])
def test_score_bodies_that_do_not_pair_up_are_a_400(fields: dict[str, Any], param: str) -> None:
    assert refused(lambda: pooling_to_engine.score_requests(score(**fields), "r")).param == param


def test_rerank_sorts_by_score_applies_top_n_and_echoes_documents() -> None:
    body = RerankRequest.model_validate({"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2})
    request = pooling_to_engine.rerank_request(body, "r", INFO)
    assert request.query.text == "q" and [d.text for d in request.documents] == ["a", "b", "c"]
    reply = engine_pb2.ScoreResponse(scores=[0.1, 0.9, 0.5])
    reply.usage.prompt_tokens = 4
    out = pooling_from_engine.rerank_result(body, reply, "rerank-r", "m")
    assert [(r["index"], r["document"]["text"]) for r in out["results"]] == [(1, "b"), (2, "c")]
    assert out["results"][0]["relevance_score"] == pytest.approx(0.9)
    assert out["usage"] == {"prompt_tokens": 4, "total_tokens": 4} and out["id"] == "rerank-r"
    bare = RerankRequest.model_validate({"query": "q", "documents": ["a", "b", "c"], "return_documents": False})
    assert [set(r) for r in pooling_from_engine.rerank_result(bare, reply, "x", "m")["results"]] == [
        {"index", "relevance_score"}] * 3
    for fields, param in (({"documents": []}, "documents"), ({"documents": ["a", ""]}, "documents[1]"),
                          ({"query": "", "documents": ["a"]}, "query")):
        bad = RerankRequest.model_validate({"query": "q", **fields})
        assert refused(lambda bad=bad: pooling_to_engine.rerank_request(bad, "r")).param == param


def test_base64_is_little_endian_float32_as_the_openai_sdk_decodes_it() -> None:
    values = [0.1, -2.5, 3.0e-8, 1234.5]
    reply = engine_pb2.EmbedResponse(embeddings=[engine_pb2.Embedding(index=0, values=values, num_tokens=2)])
    reply.usage.prompt_tokens = 2
    out = pooling_from_engine.embedding_list(reply, "m", "base64")
    decoded = array.array("f", base64.b64decode(out["data"][0]["embedding"]))
    assert decoded.tolist() == list(reply.embeddings[0].values)  # bit for bit the engine's float32 values
    assert base64.b64decode(pooling_from_engine.embedding_base64([1.0]))[::-1] == b"\x3f\x80\x00\x00"  # little-endian
    floats = pooling_from_engine.embedding_list(reply, "m", "float")
    assert floats == {"object": "list", "model": "m", "usage": {"prompt_tokens": 2, "total_tokens": 2},
                      "data": [{"object": "embedding", "index": 0, "embedding": list(reply.embeddings[0].values)}]}


def test_engine_params_are_renamed_to_the_bodys_fields() -> None:
    assert pooling_from_engine.pooling_param("input", {"input": "messages"}) == "messages"
    assert pooling_from_engine.pooling_param("documents[3]", {"documents": "text_2"}) == "text_2[3]"
    assert pooling_from_engine.pooling_param("dimensions", {}) == "dimensions"
    assert pooling_from_engine.pooling_param(None, {"input": "x"}) is None


# -- routes against the fake engine ------------------------------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine(invalid={"too long"})
    server, address = await start_fake_engine(engine)
    yield engine, address
    await server.stop(None)


@pytest.fixture
async def http(fake: tuple[FakeEngine, str], tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_client(fake[1], tmp_path) as client:
        yield client


def assert_400(response: httpx.Response, param: str | None) -> None:
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["param"] == param


async def test_embeddings_route_floats_base64_and_usage(http: httpx.AsyncClient) -> None:
    inputs = ["alpha", "beta gamma"]
    floats = (await http.post("/v1/embeddings", json={"model": MODEL, "input": inputs})).json()
    assert floats["object"] == "list" and floats["model"] == MODEL
    assert floats["usage"] == {"prompt_tokens": 15, "total_tokens": 15}
    assert [d["embedding"] for d in floats["data"]] == [fake_vector(text(t)) for t in inputs]
    assert [(d["object"], d["index"]) for d in floats["data"]] == [("embedding", 0), ("embedding", 1)]
    encoded = (await http.post("/v1/embeddings", json={"model": MODEL, "input": inputs,
                                                       "encoding_format": "base64"})).json()
    assert [array.array("f", base64.b64decode(d["embedding"])).tolist() for d in encoded["data"]] == [
        d["embedding"] for d in floats["data"]]
    short = (await http.post("/v1/embeddings", json={"model": MODEL, "input": "alpha", "dimensions": 3,
                                                     "normalize": False})).json()
    assert short["data"][0]["embedding"] == fake_vector(text("alpha"), 3, normalize=False)


async def test_the_openai_sdk_decodes_its_default_base64(http: httpx.AsyncClient) -> None:
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=http, max_retries=0)
    default = await client.embeddings.create(model=MODEL, input=["alpha", "beta gamma"])  # sends base64
    floats = await client.embeddings.create(model=MODEL, input=["alpha", "beta gamma"], encoding_format="float")
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    assert default.usage.prompt_tokens == 15 and len(default.data[0].embedding) == DIMENSIONS


async def test_embeddings_errors_are_openai_errors_naming_the_field(http: httpx.AsyncClient) -> None:
    post = http.post
    assert_400(await post("/v1/embeddings", json={"model": MODEL, "input": ""}), "input")
    assert_400(await post("/v1/embeddings", json={"model": MODEL, "input": [1, "a"]}), "input")
    assert_400(await post("/v1/embeddings", json={"model": MODEL, "input": "a", "dimensions": 9}), "dimensions")
    assert_400(await post("/v1/embeddings", json={"model": MODEL, "input": ["a", "too long"]}), "input")  # engine's
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "too long"}]}
    assert_400(await post("/v1/embeddings", json=chat), "messages")
    missing = await post("/v1/embeddings", json={"model": "other", "input": "a"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
async def test_score_route_one_against_n_and_n_against_n(http: httpx.AsyncClient, path: str) -> None:
    one = (await http.post(path, json={"model": MODEL, "text_1": "q", "text_2": ["a", "b"]})).json()
    assert [d["score"] for d in one["data"]] == pytest.approx([fake_score(text("q"), text(d)) for d in "ab"])
    assert one["object"] == "list" and one["id"].startswith("score-") and one["model"] == MODEL
    pairs = (await http.post(path, json={"queries": ["q1", "q2", "q1"], "documents": ["a", "b", "c"]})).json()
    expected = [fake_score(text(q), text(d)) for q, d in (("q1", "a"), ("q2", "b"), ("q1", "c"))]
    assert [(d["index"], d["score"]) for d in pairs["data"]] == [(i, pytest.approx(s)) for i, s in enumerate(expected)]
    assert_400(await http.post(path, json={"text_1": ["a", "b"], "text_2": ["c"]}), "text_2")
    assert_400(await http.post(path, json={"text_1": "q", "text_2": ["a", "too long"]}), "text_2")  # engine's


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
async def test_rerank_route_orders_by_score(http: httpx.AsyncClient, path: str) -> None:
    documents = ["one", "two", "three", "four"]
    body = (await http.post(path, json={"model": MODEL, "query": "q", "documents": documents, "top_n": 3})).json()
    scores = {d: fake_score(text("q"), text(d)) for d in documents}
    best = sorted(documents, key=lambda d: -scores[d])[:3]
    assert [r["document"]["text"] for r in body["results"]] == best
    assert [r["index"] for r in body["results"]] == [documents.index(d) for d in best]
    assert body["usage"]["total_tokens"] == 1 + sum(map(len, documents))
    assert_400(await http.post(path, json={"query": "q", "documents": []}), "documents")


async def test_pooling_calls_fail_over_to_another_engine_like_generation() -> None:
    fakes = [FakeEngine(), FakeEngine()]
    servers = [await start_fake_engine(f) for f in fakes]
    pool = EnginePool(GatewayConfig(engines=tuple(a for _, a in servers), health_interval_s=0.05,
                                    request_timeout_s=10))
    await pool.start()
    try:
        while len(pool.ready) < 2:
            await asyncio.sleep(0.05)
        request = pooling_to_engine.embed_request(embedding(input="alpha"), "r")
        first = pool.pick(request.inputs[:1])  # where it goes first (the cache-aware record now says so)
        fakes[[e.address for e in pool.engines].index(first.address)].unavailable = True
        reply = await calls.embed(pool, request)
        assert list(reply.embeddings[0].values) == fake_vector(text("alpha"))
        scored = await calls.score(pool, pooling_to_engine.rerank_request(
            RerankRequest.model_validate({"query": "alpha", "documents": ["b"]}), "r"))
        assert list(scored.scores) == pytest.approx([fake_score(text("alpha"), text("b"))])
        assert pool.failovers[first.address] >= 1
    finally:
        await pool.close()
        for server, _ in servers:
            await server.stop(0)


# -- batch lines -------------------------------------------------------------------------------------------------


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.mark.parametrize(("url", "endpoint"), [
    ("/v1/embeddings", "/v1/embeddings"), ("/embeddings", "/v1/embeddings"),
    ("/v1/score", "/v1/score"), ("/score", "/v1/score"),
    ("/v1/rerank", "/v1/rerank"), ("/rerank", "/v1/rerank"), ("/v2/rerank", "/v1/rerank"),
])
def test_pooling_lines_name_their_endpoint_as_vllms_run_batch_does(url: str, endpoint: str) -> None:
    bodies: dict[str, dict[str, Any]] = {"/v1/embeddings": {"model": MODEL, "input": "a"},
                                         "/v1/score": {"text_1": "q", "text_2": "a"},
                                         "/v1/rerank": {"query": "q", "documents": ["a"]}}
    body = bodies[endpoint]
    raw = json.dumps(line("a", url, **body)).encode()
    assert lines.parse_line(raw, 1, 0, endpoint, MODEL).custom_id == "a"
    assert lines.parse_line(raw, 1, 0, None, MODEL).custom_id == "a"  # `ladle batch`: any endpoint, per line


def test_pooling_lines_become_batch_priority_embed_and_score_requests() -> None:
    def requests(item: dict[str, Any]) -> list[Any]:
        return lines.engine_requests(lines.parse_line(json.dumps(item).encode(), 1, 0, None, MODEL), "rid")

    [embed] = requests(line("e", "/v1/embeddings", model=MODEL, input=["a", "b"]))
    assert isinstance(embed, engine_pb2.EmbedRequest) and embed.priority == types_pb2.PRIORITY_BATCH
    scores = requests(line("s", "/v1/score", text_1=["q1", "q2"], text_2=["a", "b"]))
    assert [type(r) for r in scores] == [engine_pb2.ScoreRequest] * 2
    assert all(r.priority == types_pb2.PRIORITY_BATCH for r in scores)
    with pytest.raises(lines.InvalidLineError) as bad:
        lines.parse_line(json.dumps(line("x", "/v1/embeddings", model=MODEL, input="")).encode(), 3, 2, None, MODEL)
    assert (bad.value.error.code, bad.value.error.line, bad.value.error.param) == ("invalid_body", 3, "body.input")


async def test_the_line_runner_answers_pooling_lines_as_the_routes_do(fake: tuple[FakeEngine, str]) -> None:
    pool = EnginePool(GatewayConfig(engines=(fake[1],), health_interval_s=0.05))
    await pool.start()
    try:
        assert await pool.wait_ready(10)
        items = [
            line("e", "/v1/embeddings", model=MODEL, input=["alpha", "beta"], encoding_format="base64"),
            line("s", "/score", text_1=["q1", "q2", "q1"], text_2=["a", "b", "c"]),
            line("r", "/v2/rerank", query="q", documents=["one", "two"]),
            line("c", "/v1/chat/completions", model=MODEL, messages=[{"role": "user", "content": "hi"}]),
            line("bad", "/v1/embeddings", model=MODEL, input="too long"),
        ]

        async def source() -> AsyncIterator[lines.InputLine]:
            for index, item in enumerate(items):
                yield lines.parse_line(json.dumps(item).encode(), index + 1, index, None, MODEL)

        results: list[LineResult] = []
        assert await LineRunner(pool, MODEL).run(source(), results.append, asyncio.Event())
    finally:
        await pool.close()
    by_id = {r.line.custom_id: r.record["response"] for r in results}
    assert sorted(by_id) == ["bad", "c", "e", "r", "s"]
    embedded = by_id["e"]["body"]["data"]
    assert [array.array("f", base64.b64decode(d["embedding"])).tolist() for d in embedded] == [
        fake_vector(text("alpha")), fake_vector(text("beta"))]
    scored = [d["score"] for d in by_id["s"]["body"]["data"]]
    assert scored == pytest.approx([fake_score(text(q), text(d)) for q, d in (("q1", "a"), ("q2", "b"), ("q1", "c"))])
    assert [r["index"] for r in by_id["r"]["body"]["results"]] == sorted(
        [0, 1], key=lambda i: -fake_score(text("q"), text(["one", "two"][i])))
    assert by_id["c"]["body"]["choices"][0]["message"]["content"] == "HI"
    assert by_id["bad"]["status_code"] == 400 and by_id["bad"]["body"]["error"]["param"] == "input"
