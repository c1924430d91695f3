"""Sampling fields at and past their limits, over HTTP (gateway) and gRPC (engine): each is refused with the exact
error naming the field, and the next valid request is served."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.adversarial.helpers import (
    HELLO,
    assert_rpc_error,
    raw_json,
    rpc_error,
    still_serves_grpc,
    still_serves_http,
)
from tests.e2e.helpers import assert_error, generate, sampling

pytestmark = pytest.mark.slow

Stub = engine_pb2_grpc.EngineServiceStub
INVALID = grpc.StatusCode.INVALID_ARGUMENT
UINT32_MAX = 2**32 - 1
CONTEXT = 8192  # the embedded model's context length


def chat(http: httpx.Client, model: str, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": HELLO, "max_tokens": 2, **fields})


def complete(http: httpx.Client, model: str, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2, **fields})


def refused(stub: Stub, **fields: Any) -> grpc.RpcError:
    return rpc_error(stub.Generate, generate("Hi", **{"max_tokens": 2, **fields}), timeout=60)


def message(error: dict[str, Any]) -> str:
    text: str = error["message"]
    return text


def test_huge_n(http: httpx.Client, stub: Stub, model_id: str) -> None:
    error = assert_error(chat(http, model_id, n=10**9), 400, "n")
    assert message(error) == "n: Input should be less than or equal to 128"
    assert error["type"] == "invalid_request_error"
    assert message(assert_error(chat(http, model_id, n=17), 400, "n")) == "n must be in [1, 16], got 17"
    assert_rpc_error(refused(stub, n=UINT32_MAX), INVALID, "n", f"n must be in [1, 16], got {UINT32_MAX}")
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_huge_and_negative_max_tokens(http: httpx.Client, stub: Stub, model_id: str) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        too_wide = assert_error(chat(http, model_id, **{field: 2**40}), 400, field)
        assert message(too_wide) == f"{field}: Input should be less than or equal to {UINT32_MAX}"
        negative = assert_error(chat(http, model_id, **{field: -1}), 400, field)
        assert message(negative) == f"{field}: Input should be greater than or equal to 1"
        assert_error(chat(http, model_id, **{field: 0}), 400, field)
    over = assert_error(complete(http, model_id, max_tokens=UINT32_MAX), 400, "max_tokens")
    assert f"maximum context length is {CONTEXT} tokens" in message(over)
    assert_rpc_error(refused(stub, max_tokens=UINT32_MAX), INVALID, "max_tokens",
                     f"maximum context length is {CONTEXT} tokens")
    assert_rpc_error(refused(stub, max_tokens=0), INVALID, "max_tokens", "max_tokens must be at least 1, got 0")
    with pytest.raises(ValueError):  # uint32: a negative max_tokens cannot even be put in the gRPC request
        types_pb2.SamplingParams(max_tokens=-1)
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_prompt_plus_max_tokens_beyond_the_context(http: httpx.Client, stub: Stub, model_id: str) -> None:
    prompt = "hi " * 8000  # 8001 tokens
    expected = (f"this model's maximum context length is {CONTEXT} tokens, but the prompt has 8001 tokens and "
                "max_tokens=500 were requested (8501 in all)")
    assert message(assert_error(complete(http, model_id, prompt=prompt, max_tokens=500), 400, "max_tokens")) == expected
    assert_rpc_error(rpc_error(stub.Generate, generate(prompt, 500), timeout=60), INVALID, "max_tokens", expected)
    # A prompt alone past the context, with no max_tokens, is the prompt's fault.
    whole = rpc_error(stub.Generate, engine_pb2.GenerateRequest(input=types_pb2.Input(text="hi " * 9000)),
                      timeout=60)
    assert_rpc_error(whole, INVALID, "prompt", "the prompt has 9001 tokens and 1 token were requested")
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_logprobs_and_top_logprobs_over_the_cap(http: httpx.Client, stub: Stub, model_id: str) -> None:
    over = assert_error(chat(http, model_id, logprobs=True, top_logprobs=21), 400, "top_logprobs")
    assert message(over) == "top_logprobs: Input should be less than or equal to 20"
    assert message(assert_error(chat(http, model_id, top_logprobs=5), 400, "top_logprobs")) == (
        "top_logprobs needs logprobs: true")
    completions = assert_error(complete(http, model_id, logprobs=21), 400, "logprobs")
    assert message(completions) == "logprobs: Input should be less than or equal to 20"
    assert_rpc_error(refused(stub, logprobs=True, top_logprobs=UINT32_MAX), INVALID, "top_logprobs",
                     f"top_logprobs must be in [0, 20], got {UINT32_MAX}")
    assert_rpc_error(refused(stub, top_logprobs=3), INVALID, "top_logprobs", "top_logprobs requires logprobs")
    at_cap = chat(http, model_id, logprobs=True, top_logprobs=20).json()["choices"][0]["logprobs"]["content"]
    assert all(len(token["top_logprobs"]) == 20 for token in at_cap)
    still_serves_grpc(stub)


def test_logit_bias_outside_the_vocabulary_or_nan(
    http: httpx.Client, stub: Stub, model_id: str, vocab_size: int
) -> None:
    oov = assert_error(chat(http, model_id, logit_bias={str(vocab_size): 1}), 400, "logit_bias")
    assert message(oov) == f"logit_bias key {vocab_size} is not a token id in [0, {vocab_size})"
    for key in ("-1", str(UINT32_MAX + 1), "99999999999999999999"):
        wide = assert_error(chat(http, model_id, logit_bias={key: 1}), 400, "logit_bias")
        assert f"logit_bias keys must be token ids, got '{key}'" in message(wide)
    body = raw_json(model=json.dumps(model_id), messages=json.dumps(HELLO), logit_bias='{"1": NaN}')
    nan = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert message(assert_error(nan, 400, "logit_bias.1")) == "logit_bias.1: Input should be a finite number"
    assert "[-100, 100]" in message(assert_error(chat(http, model_id, logit_bias={"1": 101}), 400, "logit_bias"))
    assert_rpc_error(refused(stub, logit_bias={UINT32_MAX: 1.0}), INVALID, "logit_bias",
                     f"logit_bias key {UINT32_MAX} is not a token id in [0, {vocab_size})")
    assert_rpc_error(refused(stub, logit_bias={5: float("nan")}), INVALID, "logit_bias",
                     "logit_bias must be a finite number, got nan")
    assert_rpc_error(refused(stub, logit_bias={5: float("inf")}), INVALID, "logit_bias",
                     "logit_bias must be a finite number, got inf")
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_stop_token_ids_outside_the_vocabulary_or_nan(
    http: httpx.Client, stub: Stub, model_id: str, vocab_size: int
) -> None:
    oov = assert_error(chat(http, model_id, stop_token_ids=[vocab_size]), 400, "stop_token_ids")
    assert message(oov) == f"token id {vocab_size} in stop_token_ids is not in [0, {vocab_size})"
    negative = assert_error(chat(http, model_id, stop_token_ids=[1, -5]), 400, "stop_token_ids[1]")
    assert message(negative) == "stop_token_ids[1]: Input should be greater than or equal to 0"
    wide = assert_error(chat(http, model_id, stop_token_ids=[2**40]), 400, "stop_token_ids[0]")
    assert message(wide) == f"stop_token_ids[0]: Input should be less than or equal to {UINT32_MAX}"
    body = raw_json(model=json.dumps(model_id), messages=json.dumps(HELLO), stop_token_ids="[NaN]")
    nan = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert message(assert_error(nan, 400, "stop_token_ids[0]")) == "stop_token_ids[0]: Input should be a finite number"
    assert_rpc_error(refused(stub, stop_token_ids=[1, UINT32_MAX]), INVALID, "stop_token_ids",
                     f"token id {UINT32_MAX} in stop_token_ids is not in [0, {vocab_size})")
    still_serves_http(http, model_id)
    still_serves_grpc(stub)


def test_token_id_prompts_out_of_range(http: httpx.Client, stub: Stub, model_id: str, vocab_size: int) -> None:
    oov = assert_error(complete(http, model_id, prompt=[1, vocab_size]), 400, "prompt")
    assert message(oov) == f"token id {vocab_size} in prompt is not in [0, {vocab_size})"
    for prompt in ([1, -1], [1, 2**40], [[1, 2], [2**33]]):
        wide = assert_error(complete(http, model_id, prompt=prompt), 400, "prompt")
        assert message(wide) == "prompt token ids must be token ids (>= 0 and within the vocabulary)"
    ids = engine_pb2.GenerateRequest(input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[1, UINT32_MAX])),
                                     sampling=sampling(2))
    assert_rpc_error(rpc_error(stub.Generate, ids, timeout=60), INVALID, "prompt",
                     f"token id {UINT32_MAX} in prompt is not in [0, {vocab_size})")
    last = engine_pb2.GenerateRequest(input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=[vocab_size - 1])),
                                      sampling=sampling(2))
    assert len(stub.Generate(last, timeout=60).choices[0].token_ids) == 2  # the last id is a token id
    still_serves_http(http, model_id)


def test_temperature_1e_9_is_greedy(http: httpx.Client, stub: Stub, model_id: str) -> None:
    tiny = chat(http, model_id, temperature=1e-9, max_tokens=4)
    greedy = chat(http, model_id, temperature=0, max_tokens=4)
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
    greedy_ids = stub.Generate(generate("Once upon a time", 4), timeout=60).choices[0].token_ids
    # Below float32's normal range (1e-45 is a denormal): dividing logits by it would overflow to inf.
    for temperature in (1e-9, 1e-45):
        tiny_ids = stub.Generate(generate("Once upon a time", 4, temperature=temperature), timeout=60)
        assert tiny_ids.choices[0].token_ids == greedy_ids


@pytest.mark.parametrize(
    ("field", "literal"),
    [("temperature", "NaN"), ("top_p", "Infinity"), ("presence_penalty", "-Infinity"), ("min_p", "NaN"),
     ("repetition_penalty", "NaN"), ("max_tokens", "Infinity"), ("seed", "NaN"), ("frequency_penalty", "1e999")],
)
def test_nan_and_infinity_literals_in_the_json_body(
    http: httpx.Client, model_id: str, field: str, literal: str
) -> None:
    body = raw_json(model=json.dumps(model_id), messages=json.dumps(HELLO), **{field: literal})
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert message(assert_error(response, 400, field)) == f"{field}: Input should be a finite number"
    still_serves_http(http, model_id)


def test_nan_and_infinity_over_grpc(stub: Stub) -> None:
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (float("nan"), float("inf"), float("-inf")):
            assert_rpc_error(refused(stub, **{field: value}), INVALID, field,
                             f"{field} must be a finite number, got {value}")
    still_serves_grpc(stub)
