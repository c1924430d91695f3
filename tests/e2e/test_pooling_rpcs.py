"""Embed, Score and pooling items of Batch through the generated stubs against a real `ladle engine` process
(the embedded model on its default, quantized path)."""

from __future__ import annotations

import math
from typing import TypeAlias

import grpc
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.helpers import chat_input, generate, text_input

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub
TEXTS = ["Hello world", "The capital of France is Paris.", "Bananas are yellow and rich in potassium."]


def _embed(stub: Stub, inputs: list[types_pb2.Input], **fields: object) -> engine_pb2.EmbedResponse:
    reply: engine_pb2.EmbedResponse = stub.Embed(engine_pb2.EmbedRequest(inputs=inputs, **fields), timeout=60)
    return reply


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_model_info_reports_the_pooling(stub: Stub) -> None:
    pooling = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5).pooling
    assert (pooling.method, pooling.normalize, pooling.dimensions) == ("last", True, 576)


def test_embed_returns_one_normalized_vector_per_input_batch_invariant(stub: Stub) -> None:
    reply = _embed(stub, [text_input(t) for t in TEXTS], request_id="embed-1")
    assert reply.request_id == "embed-1" and reply.model == "SmolLM2-135M-Instruct"
    assert [e.index for e in reply.embeddings] == [0, 1, 2]
    for embedding in reply.embeddings:
        assert len(embedding.values) == 576
        assert math.isclose(math.sqrt(sum(v * v for v in embedding.values)), 1.0, rel_tol=1e-5)
    assert reply.usage.prompt_tokens == sum(e.num_tokens for e in reply.embeddings) == reply.usage.total_tokens
    assert reply.usage.completion_tokens == 0
    # The quantized path is batch-invariant: each input alone gives the same bits.
    for text, embedding in zip(TEXTS, reply.embeddings, strict=True):
        (alone,) = _embed(stub, [text_input(text)]).embeddings
        assert list(alone.values) == list(embedding.values)


def test_embed_dimensions_normalize_token_ids_and_chat(stub: Stub) -> None:
    (whole,) = _embed(stub, [text_input(TEXTS[1])], normalize=False).embeddings
    (short,) = _embed(stub, [text_input(TEXTS[1])], dimensions=32).embeddings
    norm = math.sqrt(sum(v * v for v in whole.values[:32]))
    assert list(short.values) == pytest.approx([v / norm for v in whole.values[:32]], rel=1e-5, abs=1e-6)
    ids = stub.Tokenize(engine_pb2.TokenizeRequest(input=text_input(TEXTS[1])), timeout=10).token_ids
    (by_ids,) = _embed(stub, [types_pb2.Input(token_ids=types_pb2.TokenIds(ids=ids))], normalize=False).embeddings
    assert list(by_ids.values) == list(whole.values)
    (chat,) = _embed(stub, [chat_input("What is an embedding?")]).embeddings
    assert len(chat.values) == 576 and chat.num_tokens > 5


def test_score_is_the_cosine_of_the_embeddings(stub: Stub) -> None:
    query = "Which city is the capital of France?"
    reply = stub.Score(
        engine_pb2.ScoreRequest(query=text_input(query), documents=[text_input(t) for t in TEXTS]), timeout=60
    )
    vectors = [list(e.values) for e in _embed(stub, [text_input(t) for t in [query, *TEXTS]]).embeddings]
    assert list(reply.scores) == pytest.approx([_cosine(vectors[0], v) for v in vectors[1:]], abs=1e-5)
    assert max(range(3), key=lambda i: reply.scores[i]) == 1  # the Paris sentence
    assert reply.usage.prompt_tokens == sum(
        len(stub.Tokenize(engine_pb2.TokenizeRequest(input=text_input(t)), timeout=10).token_ids)
        for t in [query, *TEXTS]
    )


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"inputs": []}, "input"),
        ({"inputs": [text_input("x")], "dimensions": 577}, "dimensions"),
        ({"inputs": [text_input("")]}, "input"),
        ({"inputs": [types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[1] * 9000))]}, "input"),
        ({"inputs": [types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[10**6]))]}, "input"),
    ],
)
def test_bad_embed_requests_are_invalid_argument_naming_the_field(
    stub: Stub, request_fields: dict[str, object], param: str
) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        stub.Embed(engine_pb2.EmbedRequest(**request_fields), timeout=30)  # type: ignore[arg-type]
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("ladle-param", param) in tuple(failure.value.trailing_metadata() or ())


def test_a_long_input_is_truncated_to_its_last_tokens_when_asked(stub: Stub) -> None:
    ids = [(i % 1000) + 10 for i in range(9000)]
    (kept,) = _embed(
        stub, [types_pb2.Input(token_ids=types_pb2.TokenIds(ids=ids))], truncate_prompt_tokens=16
    ).embeddings
    (last,) = _embed(stub, [types_pb2.Input(token_ids=types_pb2.TokenIds(ids=ids[-16:]))]).embeddings
    assert kept.num_tokens == 16 and list(kept.values) == list(last.values)


def test_batch_runs_embed_and_score_items_beside_generations(stub: Stub) -> None:
    items = [
        engine_pb2.BatchRequest(item_id="gen", request=generate("The capital of France is", 4)),
        engine_pb2.BatchRequest(item_id="emb", embed=engine_pb2.EmbedRequest(inputs=[text_input(TEXTS[0])])),
        engine_pb2.BatchRequest(
            item_id="score",
            score=engine_pb2.ScoreRequest(query=text_input("fruit"), documents=[text_input(t) for t in TEXTS]),
        ),
        engine_pb2.BatchRequest(
            item_id="bad", embed=engine_pb2.EmbedRequest(inputs=[text_input("x")], dimensions=9999)
        ),
        engine_pb2.BatchRequest(
            item_id="both", request=generate("x", 1), embed=engine_pb2.EmbedRequest(inputs=[text_input("x")])
        ),
    ]
    results = {r.item_id: r for r in stub.Batch(iter(items), timeout=120)}
    assert set(results) == {"gen", "emb", "score", "bad", "both"}
    assert results["gen"].WhichOneof("outcome") == "result" and len(results["gen"].result.choices[0].token_ids) == 4
    (alone,) = _embed(stub, [text_input(TEXTS[0])]).embeddings
    assert list(results["emb"].embed_result.embeddings[0].values) == list(alone.values)
    assert len(results["score"].score_result.scores) == 3
    assert results["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert results["bad"].error.param == "dimensions"
    assert results["both"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
