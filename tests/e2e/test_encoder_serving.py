"""A BERT-style encoder served from a local sentence-transformers folder: `ladle engine --model FOLDER` behind
`ladle gateway`, used through the official openai SDK and vLLM's rerank route, and checked against transformers;
and a cross-encoder (BertForSequenceClassification) reranking through the same route."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from ladle.client import EngineClient
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.unit.pooling.embedding_models import (
    load_reference,
    reference_embedding,
    reference_pair_scores,
    save_bert,
)

TEXTS = ["Hello world", "The capital of France is Paris.", "Bananas are yellow and rich in potassium."]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, EngineProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("encoder")
    folder = save_bert(root / "bert", pooling="mean_tokens", normalize=True)
    engine = start_engine(root / "engine.log", "--model", str(folder), threads=1)
    gateway = start_gateway(root / "gateway.log", engine.address)
    yield folder, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


@pytest.fixture(scope="module")
def reference(encoder: tuple[Path, EngineProcess, GatewayProcess]) -> Any:
    return load_reference(encoder[0])


def _tokens(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    ids: list[int] = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    return ids


def test_the_openai_sdk_embeds_with_the_encoder_as_transformers(
    encoder: tuple[Path, EngineProcess, GatewayProcess], reference: Any
) -> None:
    folder, engine, gateway = encoder
    with EngineClient(engine.address) as client:
        info = client.model_info()
    assert (info.architecture, info.pooling.method, info.pooling.normalize) == ("bert", "mean", True)
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    reply = sdk.embeddings.create(model=info.model_id, input=TEXTS)  # the SDK's default: base64 on the wire
    for text, item in zip(TEXTS, reply.data, strict=True):
        expected = reference_embedding(reference, _tokens(folder, text), "mean_tokens", normalize=True)
        ours = torch.tensor(item.embedding)
        assert float((ours - expected).norm() / expected.norm()) <= 1e-5
    assert reply.usage.prompt_tokens == sum(len(_tokens(folder, t)) for t in TEXTS)


def test_rerank_orders_documents_as_transformers_cosines(
    encoder: tuple[Path, EngineProcess, GatewayProcess], reference: Any
) -> None:
    folder, _, gateway = encoder
    query = "what is the capital of france"
    response = httpx.post(
        gateway.base_url + "/rerank", json={"model": "bert", "query": query, "documents": TEXTS}, timeout=60
    )
    assert response.status_code == 200, response.text
    order = [result["index"] for result in response.json()["results"]]

    def vector(text: str) -> torch.Tensor:
        return reference_embedding(reference, _tokens(folder, text), "mean_tokens", normalize=True)

    cosines = [float(vector(query) @ vector(text)) for text in TEXTS]
    assert order == sorted(range(len(TEXTS)), key=lambda i: -cosines[i])
    scores = [result["relevance_score"] for result in response.json()["results"]]
    assert scores == pytest.approx(sorted(cosines, reverse=True), abs=1e-5)


def test_generation_on_an_encoder_is_a_clear_400(encoder: tuple[Path, EngineProcess, GatewayProcess]) -> None:
    _, _, gateway = encoder
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="encoder"):
        sdk.chat.completions.create(model="bert", messages=[{"role": "user", "content": "Hello"}])


def test_a_cross_encoder_reranks_as_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    folder = save_bert(tmp_path / "cross", pooling=None, cross_encoder=True)
    engine = start_engine(tmp_path / "engine.log", "--model", str(folder), threads=1)
    gateway = start_gateway(tmp_path / "gateway.log", engine.address)
    try:
        with EngineClient(engine.address) as client:
            assert client.model_info().pooling.cross_encoder
        query = "what is the capital of france"
        response = httpx.post(
            gateway.base_url + "/rerank",
            json={"model": "cross", "query": query, "documents": TEXTS, "top_n": 2},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        reference = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
        expected = reference_pair_scores(folder, reference, query, TEXTS)
        best = sorted(range(len(TEXTS)), key=lambda i: -expected[i])[:2]
        assert [result["index"] for result in results] == best
        assert [result["relevance_score"] for result in results] == pytest.approx([expected[i] for i in best], abs=1e-5)
    finally:
        assert gateway.stop() == 0
        assert engine.stop() == 0
