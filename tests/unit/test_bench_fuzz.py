"""The schema-fuzzing harness (benchmarks/fuzz_cases.py, fuzz_gateway.py): cheap bodies (generation and pooling)
stay valid, the error-shape check, the stages of the long run."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from schemathesis import GenerationMode

from benchmarks.fuzz_cases import (
    CHEAP_INPUT_TOKENS,
    CHEAP_ITEMS,
    CHEAP_MAX_TOKENS,
    CHEAP_N,
    CHEAP_TEXT_CHARS,
    GENERATION_ROUTES,
    cheapen_body,
    cheapen_case,
    cheapen_pooling_body,
    cheapen_sglang_body,
    error_shape_problem,
)
from benchmarks.fuzz_gateway import parse_args, stages
from gateway.errors import APIError
from gateway.schemas.chat import BatchChatCompletionRequest, ChatCompletionRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from gateway.translate import pooling_to_engine

LONG = "word " * 100


def test_cheap_bodies_stay_valid_and_cost_little() -> None:
    message = {"role": "user", "content": "hi"}
    chat = cheapen_body({"model": "x", "messages": [message] * 9, "n": 100, "max_completion_tokens": 149.0,
                         "min_tokens": 10**6}, "served")
    parsed = ChatCompletionRequest.model_validate(chat)
    assert parsed.model == "served" and parsed.n == 2 and len(parsed.messages) == CHEAP_ITEMS
    assert parsed.completion_cap() == CHEAP_MAX_TOKENS and parsed.min_tokens == CHEAP_MAX_TOKENS
    completion = CompletionRequest.model_validate(cheapen_body({"model": "x", "prompt": [[1]] * 9}, "served"))
    assert completion.max_tokens == CHEAP_MAX_TOKENS and len(completion.prompts()) == CHEAP_ITEMS
    batch = cheapen_body({"model": "x", "messages": [[message]] * 9, "max_tokens": None}, "served")
    assert BatchChatCompletionRequest.model_validate(batch).max_tokens == CHEAP_MAX_TOKENS


def test_cheap_pooling_bodies_stay_valid_and_cost_little() -> None:
    texts = EmbeddingRequest.model_validate(cheapen_pooling_body({"model": "x", "input": [LONG] * 9}, "served"))
    assert texts.model == "served" and [len(t) for t in texts.inputs()] == [CHEAP_TEXT_CHARS] * CHEAP_ITEMS
    one_id_list = EmbeddingRequest.model_validate(cheapen_pooling_body({"model": "x", "input": [1] * 99}, "served"))
    assert one_id_list.inputs() == [[1] * CHEAP_INPUT_TOKENS]  # one input, shorter, not several
    id_lists = EmbeddingRequest.model_validate(cheapen_pooling_body({"model": "x", "input": [[1] * 99] * 9}, "s"))
    assert id_lists.inputs() == [[1] * CHEAP_INPUT_TOKENS] * CHEAP_ITEMS
    chat = cheapen_pooling_body({"model": "x", "messages": [{"role": "user", "content": "hi"}] * 9}, "served")
    [conversation] = pooling_to_engine.embed_request(EmbeddingRequest.model_validate(chat), "r").inputs
    assert len(conversation.chat.messages) == CHEAP_ITEMS
    n_vs_n = ScoreRequest.model_validate(cheapen_pooling_body({"text_1": [LONG] * 9, "text_2": ["b"] * 9}, "served"))
    queries, documents, _ = pooling_to_engine.score_pairs(n_vs_n)  # still pairs up
    assert n_vs_n.model == "served" and len(queries) == len(documents) == CHEAP_ITEMS
    one_vs_n = ScoreRequest.model_validate(cheapen_pooling_body({"queries": LONG, "documents": [LONG] * 9}, "s"))
    assert pooling_to_engine.score_pairs(one_vs_n)[:2] == ([LONG[:CHEAP_TEXT_CHARS]] * CHEAP_ITEMS,
                                                          [LONG[:CHEAP_TEXT_CHARS]] * CHEAP_ITEMS)
    rerank = RerankRequest.model_validate(cheapen_pooling_body(
        {"query": LONG, "documents": [LONG, {"text": LONG, "title": "t"}] * 5, "top_n": 3}, "served"))
    request = pooling_to_engine.rerank_request(rerank, "r")
    assert len(request.query.text) == CHEAP_TEXT_CHARS and rerank.top_n == 3
    assert [len(d.text) for d in request.documents] == [CHEAP_TEXT_CHARS] * CHEAP_ITEMS


def _case(path: str, body: dict[str, Any], mode: GenerationMode) -> Any:
    """A stand-in for a schemathesis Case: only what cheapen_case reads."""
    meta = SimpleNamespace(components={"body": SimpleNamespace(mode=mode)})
    return SimpleNamespace(path=path, body=body, meta=meta)


def test_cheapen_case_cheapens_positive_generation_and_pooling_bodies_only() -> None:
    many = {"model": "x", "input": ["a"] * 9}
    assert len(cheapen_case(_case("/v1/embeddings", many, GenerationMode.POSITIVE), "m").body["input"]) == CHEAP_ITEMS
    rerank = {"query": "q", "documents": ["a"] * 9}
    assert len(cheapen_case(_case("/v1/rerank", rerank, GenerationMode.POSITIVE), "m").body["documents"]) == CHEAP_ITEMS
    score = {"text_1": "q", "text_2": ["a"] * 9}
    assert cheapen_case(_case("/v1/score", score, GenerationMode.POSITIVE), "m").body["model"] == "m"
    chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    cheap_chat = cheapen_case(_case("/v1/chat/completions", chat, GenerationMode.POSITIVE), "m").body
    assert cheap_chat["max_tokens"] == CHEAP_MAX_TOKENS
    assert cheapen_case(_case("/v1/embeddings", many, GenerationMode.NEGATIVE), "m").body is many  # as drawn
    assert cheapen_case(_case("/v1/models", many, GenerationMode.POSITIVE), "m").body is many


def test_error_shape() -> None:
    good = json.dumps(APIError(400, "bad", param="n").body()).encode()
    assert error_shape_problem(400, "application/json", good) is None
    assert error_shape_problem(200, "text/event-stream", b"data: {}") is None  # not an error
    assert error_shape_problem(422, "application/json", b'{"detail": []}') is not None  # FastAPI's own shape
    assert error_shape_problem(500, "text/plain", b"Internal Server Error") is not None
    missing_code = json.dumps({"error": {"message": "m", "type": "t", "param": None}}).encode()
    assert error_shape_problem(404, "application/json", missing_code) is not None


def test_the_long_run_gives_the_generating_routes_a_stage_of_their_own() -> None:
    every, focus = stages(parse_args(["--max-time", "900", "--focus-share", "0.5"]))
    assert every.paths is None and "stateful" in every.phases and every.max_time_s == 450
    assert focus.paths == tuple(sorted(GENERATION_ROUTES)) and focus.phases == ("fuzzing",)
    assert [s.paths for s in stages(parse_args(["--focus-share", "0"]))] == [None]


def test_sglang_bodies_are_cheapened_inside_their_sampling_params() -> None:
    batch = cheapen_sglang_body({"text": ["a"] * 9, "sampling_params": [{"max_new_tokens": 500, "n": 9}] * 9})
    assert batch["text"] == ["a"] * CHEAP_ITEMS
    assert batch["sampling_params"] == [{"max_new_tokens": CHEAP_MAX_TOKENS, "n": CHEAP_N}] * CHEAP_ITEMS
    single = cheapen_sglang_body({"input_ids": [1, 2, 3]})
    assert single == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CHEAP_MAX_TOKENS}}
