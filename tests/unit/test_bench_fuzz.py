"""The schema-fuzzing harness (benchmarks/fuzz_cases.py, fuzz_gateway.py): cheap bodies stay valid, the
error-shape check, the stages of the long run."""

from __future__ import annotations

import json

from benchmarks.fuzz_cases import CHEAP_ITEMS, CHEAP_MAX_TOKENS, GENERATION_ROUTES, cheapen_body, error_shape_problem
from benchmarks.fuzz_gateway import parse_args, stages
from gateway.errors import APIError
from gateway.schemas.chat import BatchChatCompletionRequest, ChatCompletionRequest
from gateway.schemas.completions import CompletionRequest


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
