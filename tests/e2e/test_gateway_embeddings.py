"""Embeddings, score and rerank through real `ladle gateway` + `ladle engine` processes (the embedded model, last-token
pooling): the official openai SDK's `embeddings.create` (float, its default base64, explicit base64, dimensions)
against the engine's own Embed RPC, vLLM's `/v1/score` and `/v1/rerank` against the cosine similarities of the
route's embeddings, and batch jobs of `/v1/embeddings` (1,000 lines, each custom_id once), `/v1/score` and
`/v1/rerank` lines whose bodies are what the routes answer; `ladle batch` runs such lines too."""

from __future__ import annotations

import base64
import itertools
import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import EngineProcess

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Stock markets fell sharply today."]
QUERY = "Which city is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "The cat chased a mouse around the kitchen.",
             "Berlin is the capital of Germany.", "Bread is baked in an oven.", "France borders Spain and Italy."]
FINAL = {"completed", "failed", "cancelled", "expired"}


def engine_vectors(stub: engine_pb2_grpc.EngineServiceStub, texts: list[str], **fields: Any) -> list[list[float]]:
    request = engine_pb2.EmbedRequest(inputs=[types_pb2.Input(text=t) for t in texts], **fields)
    return [list(e.values) for e in stub.Embed(request, timeout=120).embeddings]


def assert_vectors(got: list[list[float]], expected: list[list[float]], atol: float = 1e-6) -> None:
    assert [len(v) for v in got] == [len(v) for v in expected]
    for a, b in zip(got, expected, strict=True):
        assert np.allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol), np.abs(np.subtract(a, b)).max()


def assert_descending(order: list[int], values: list[float], tol: float = 1e-4) -> None:
    """`order` ranks `values` best first (a pair closer than `tol` may come either way: separate forward passes)."""
    ranked = [values[i] for i in order]
    assert all(a >= b - tol for a, b in itertools.pairwise(ranked)), (order, values)


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def pooling(stub: engine_pb2_grpc.EngineServiceStub) -> engine_pb2.PoolingInfo:
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30).pooling
    assert info.dimensions > 0
    return info


# -- /v1/embeddings --------------------------------------------------------------------------------------------


def test_sdk_embeddings_equal_the_engines_float_and_base64(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub,
    pooling: engine_pb2.PoolingInfo,
) -> None:
    expected = engine_vectors(stub, TEXTS)
    floats = openai_client.embeddings.create(model=model_id, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == model_id
    assert [d.index for d in floats.data] == [0, 1, 2] and len(floats.data[0].embedding) == pooling.dimensions
    assert_vectors([d.embedding for d in floats.data], expected)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)

    default = openai_client.embeddings.create(model=model_id, input=TEXTS)  # the SDK asks for base64, decodes it
    assert_vectors([d.embedding for d in default.data], expected)
    raw = openai_client.embeddings.create(model=model_id, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(str(d.embedding)), dtype="<f4").tolist() for d in raw.data]
    assert_vectors(decoded, expected)
    if pooling.normalize:
        assert all(math.isclose(float(np.linalg.norm(v)), 1.0, abs_tol=1e-5) for v in decoded)


def test_dimensions_token_ids_and_refusals(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub,
    pooling: engine_pb2.PoolingInfo,
) -> None:
    short = openai_client.embeddings.create(model=model_id, input=TEXTS[0], dimensions=64, encoding_format="float")
    assert_vectors([short.data[0].embedding], engine_vectors(stub, TEXTS[:1], dimensions=64))
    assert len(short.data[0].embedding) == 64

    ids = list(stub.Tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(text=TEXTS[1])), timeout=30).token_ids)
    by_ids = openai_client.embeddings.create(model=model_id, input=[ids, ids[:3]], encoding_format="float")
    assert len(by_ids.data) == 2 and by_ids.usage.prompt_tokens == len(ids) + 3
    assert_vectors([by_ids.data[0].embedding], engine_vectors(stub, TEXTS[1:2]))  # the text's own tokens

    for kwargs, param in (({"input": ""}, "input"), ({"input": ["a", ""]}, "input[1]"),
                          ({"input": "a", "dimensions": pooling.dimensions + 1}, "dimensions")):
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.embeddings.create(model=model_id, encoding_format="float", **kwargs)
        assert refused.value.status_code == 400 and refused.value.param == param


# -- /v1/score and /v1/rerank ---------------------------------------------------------------------------------


def route_vectors(http: httpx.Client, model: str, texts: list[str]) -> list[list[float]]:
    body = http.post("/v1/embeddings", json={"model": model, "input": texts}).json()
    return [d["embedding"] for d in body["data"]]


def test_score_and_rerank_order_as_the_embeddings_cosines(gateway_http: httpx.Client, model_id: str) -> None:
    vectors = route_vectors(gateway_http, model_id, [QUERY, *DOCUMENTS])
    cosines = [cosine(vectors[0], v) for v in vectors[1:]]

    scored = gateway_http.post("/v1/score", json={"model": model_id, "text_1": QUERY, "text_2": DOCUMENTS})
    assert scored.status_code == 200, scored.text
    body = scored.json()
    assert body["object"] == "list" and body["model"] == model_id and body["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    scores = [d["score"] for d in body["data"]]
    assert np.allclose(scores, cosines, atol=1e-4), (scores, cosines)

    ranked = gateway_http.post("/v1/rerank", json={"model": model_id, "query": QUERY, "documents": DOCUMENTS}).json()
    order = [r["index"] for r in ranked["results"]]
    assert sorted(order) == list(range(len(DOCUMENTS)))
    assert_descending(order, cosines)
    assert_descending(order, scores)
    assert [r["document"]["text"] for r in ranked["results"]] == [DOCUMENTS[i] for i in order]
    assert np.allclose([r["relevance_score"] for r in ranked["results"]], [scores[i] for i in order], atol=1e-5)
    assert ranked["usage"]["total_tokens"] == body["usage"]["total_tokens"]

    top = gateway_http.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                                "return_documents": False}).json()
    assert len(top["results"]) == 2 and "document" not in top["results"][0]
    assert_descending([r["index"] for r in top["results"]] + order[2:], scores)


def test_score_n_against_n_pairs_element_wise(gateway_http: httpx.Client, model_id: str) -> None:
    queries = [QUERY, "Where do cats sleep?", QUERY]
    documents = DOCUMENTS[:3]
    body = gateway_http.post("/score", json={"queries": queries, "documents": documents}).json()
    one_by_one = [gateway_http.post("/v1/score", json={"text_1": q, "text_2": d}).json()["data"][0]["score"]
                  for q, d in zip(queries, documents, strict=True)]
    assert np.allclose([d["score"] for d in body["data"]], one_by_one, atol=1e-5)
    mismatched = gateway_http.post("/v1/score", json={"text_1": queries, "text_2": documents[:2]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"


# -- batch jobs ------------------------------------------------------------------------------------------------


def run_batch(client: openai.OpenAI, tmp: Path, endpoint: str, items: list[dict[str, Any]],
              timeout: float = 300) -> tuple[Any, list[dict[str, Any]]]:
    path = tmp / f"in-{time.monotonic_ns()}.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    with path.open("rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    while batch.status not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.25)
        batch = client.batches.retrieve(batch.id)
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()] \
        if batch.output_file_id else []
    return batch, lines


def test_a_batch_of_1000_embedding_lines_answers_each_custom_id_once(
    openai_client: openai.OpenAI, model_id: str, stub: engine_pb2_grpc.EngineServiceStub, tmp_path: Path,
) -> None:
    items = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": model_id, "input": f"item {i}", "encoding_format": "float"}} for i in range(1000)]
    batch, lines = run_batch(openai_client, tmp_path, "/v1/embeddings", items)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None and batch.request_counts.completed == 1000
    assert Counter(line["custom_id"] for line in lines) == Counter(item["custom_id"] for item in items)
    assert all(line["response"]["status_code"] == 200 for line in lines)
    by_id = {line["custom_id"]: line["response"]["body"] for line in lines}
    sample = [0, 499, 999]
    expected = engine_vectors(stub, [f"item {i}" for i in sample])
    assert_vectors([by_id[f"e{i}"]["data"][0]["embedding"] for i in sample], expected, atol=1e-5)
    assert set(by_id["e7"]) == {"object", "data", "model", "usage"} and by_id["e7"]["model"] == model_id


def test_score_and_rerank_batch_lines_answer_as_the_routes(
    openai_client: openai.OpenAI, gateway_http: httpx.Client, model_id: str, tmp_path: Path,
) -> None:
    score_body = {"model": model_id, "text_1": QUERY, "text_2": DOCUMENTS}
    rerank_body = {"model": model_id, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    for endpoint, url, body in (("/v1/score", "/score", score_body), ("/v1/rerank", "/v2/rerank", rerank_body)):
        items = [{"custom_id": f"{endpoint}-{i}", "method": "POST", "url": url, "body": body} for i in range(3)]
        batch, lines = run_batch(openai_client, tmp_path, endpoint, items)
        assert batch.status == "completed", batch.errors
        route = gateway_http.post(endpoint, json=body).json()
        for line in lines:
            got = line["response"]["body"]
            assert set(got) == set(route) and got["model"] == route["model"] and got["usage"] == route["usage"]
            key = "data" if endpoint == "/v1/score" else "results"
            assert [r["index"] for r in got[key]] == [r["index"] for r in route[key]]
            field = "score" if endpoint == "/v1/score" else "relevance_score"
            assert np.allclose([r[field] for r in got[key]], [r[field] for r in route[key]], atol=1e-5)


def test_a_mixed_file_is_refused_by_an_embeddings_batch(openai_client: openai.OpenAI, model_id: str,
                                                        tmp_path: Path) -> None:
    items = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": model_id, "input": "x"}},
             {"custom_id": "b", "method": "POST", "url": "/v1/score", "body": {"text_1": "q", "text_2": "d"}}]
    batch, _ = run_batch(openai_client, tmp_path, "/v1/embeddings", items)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("invalid_url", 2)]


def test_ladle_batch_runs_pooling_lines(engine: EngineProcess, model_id: str, tmp_path: Path) -> None:
    items = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": model_id, "input": "x"}},
             {"custom_id": "s", "method": "POST", "url": "/score", "body": {"text_1": QUERY, "text_2": DOCUMENTS}},
             {"custom_id": "r", "method": "POST", "url": "/rerank", "body": {"query": QUERY, "documents": DOCUMENTS}}]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(i) + "\n" for i in items))
    done = subprocess.run([sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output),
                           "--engine", engine.address], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = {line["custom_id"]: line["response"] for line in map(json.loads, output.read_text().splitlines())}
    assert sorted(lines) == ["e", "r", "s"] and all(r["status_code"] == 200 for r in lines.values())
    assert len(lines["s"]["body"]["data"]) == len(lines["r"]["body"]["results"]) == len(DOCUMENTS)
