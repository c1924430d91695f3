"""Prompt log-probabilities served, against the real engine on the embedded model: over gRPC
(`SamplingParams.prompt_logprobs`: Generate, and Stream's first message only), and through the gateway as
`/v1/completions` with `echo` and `logprobs`, the request lm-evaluation-harness sends for log-likelihoods (a text
prompt, or its token ids; whole or streamed): the echoed prompt's tokens come first, the first with a null logprob,
each later one with the engine's own logprob."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.helpers import generate, stream, text_input

pytestmark = pytest.mark.slow

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub
PROMPT = "The capital of France is Paris, and the capital of Italy is"


def prompt_ids(stub: Stub) -> list[int]:
    return list(stub.Tokenize(engine_pb2.TokenizeRequest(input=text_input(PROMPT)), timeout=10).token_ids)


def test_generate_and_stream_return_the_prompts_logprobs(stub: Stub) -> None:
    ids = prompt_ids(stub)
    request = generate(PROMPT, 2)
    request.sampling.prompt_logprobs = 2
    reply = stub.Generate(request, timeout=60)
    found = reply.prompt_logprobs
    assert found.first_token_id == ids[0] and found.first_token
    assert [entry.token_id for entry in found.tokens] == ids[1:]
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in found.tokens)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-5 for entry in found.tokens)
    assert not stub.Generate(generate(PROMPT, 2), timeout=60).HasField("prompt_logprobs")

    streamed = stream(PROMPT, 4)
    streamed.sampling.prompt_logprobs = 2
    messages = list(stub.Stream(streamed, timeout=60))
    assert messages[0].prompt_logprobs == found
    assert not any(m.HasField("prompt_logprobs") for m in messages[1:])


def completion(gateway_http: httpx.Client, model_id: str, prompt: str | list[int], **fields: Any) -> dict[str, Any]:
    body = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1,
            **fields}
    reply = gateway_http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def test_completions_echo_logprobs_as_lm_eval_harness_asks(gateway_http: httpx.Client, model_id: str,
                                                            stub: Stub) -> None:
    ids = prompt_ids(stub)
    request = generate(PROMPT, 1)
    request.sampling.prompt_logprobs = 1
    engine_found = stub.Generate(request, timeout=60).prompt_logprobs

    by_text = completion(gateway_http, model_id, PROMPT)
    choice = by_text["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and by_text["usage"]["prompt_tokens"] == len(ids)
    assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt's tokens, then the one generated
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx([e.logprob for e in engine_found.tokens],
                                                                    abs=1e-5)
    assert "".join(logprobs["tokens"][:len(ids)]) == PROMPT
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][len(ids)] == len(PROMPT)
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])

    by_ids = completion(gateway_http, model_id, ids)  # lm-eval's tokenized_requests: the prompt as token ids
    assert by_ids["choices"][0]["text"] == choice["text"]
    assert by_ids["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    plain_ids = completion(gateway_http, model_id, ids, logprobs=None)  # echo alone: the ids' text
    assert plain_ids["choices"][0]["text"] == choice["text"] and plain_ids["choices"][0]["logprobs"] is None

    with gateway_http.stream("POST", "/v1/completions", json={
            "model": model_id, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "stream": True}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["tokens"] == logprobs["tokens"][:len(ids)]
    assert first["logprobs"]["token_logprobs"][0] is None
    streamed_tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert streamed_tokens[:len(ids) + 1] == logprobs["tokens"]


def test_max_tokens_0_answers_the_prompt_alone(gateway_http: httpx.Client, model_id: str, stub: Stub) -> None:
    """vLLM's `max_tokens: 0` with echo: the prompt and its logprobs, no completion, no output tokens counted."""
    ids = prompt_ids(stub)
    whole = completion(gateway_http, model_id, PROMPT, max_tokens=0)
    choice = whole["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == completion(gateway_http, model_id, PROMPT)["choices"][0]["logprobs"][
        "tokens"][:len(ids)]
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == len(ids)
    with gateway_http.stream("POST", "/v1/completions", json={
            "model": model_id, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == PROMPT
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    refused = gateway_http.post("/v1/completions", json={"model": model_id, "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_vllms_prompt_logprobs_field(gateway_http: httpx.Client, model_id: str, stub: Stub) -> None:
    """vLLM's `prompt_logprobs` (extra_body) on completions (per choice) and chat (per response): None for the first
    prompt token, then a dict by token id of the prompt's token (its rank) and the k best (ranks 1..k)."""
    ids = prompt_ids(stub)
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    found = gateway_http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert found[0] is None and len(found) == len(ids)
    for token_id, entry in zip(ids[1:], found[1:], strict=True):
        assert str(token_id) in entry and entry[str(token_id)]["rank"] >= 1 and 2 <= len(entry) <= 3
        assert sorted(v["rank"] for k, v in entry.items() if k != str(token_id))[:2] in ([1, 2], [1], [2])
    chat = gateway_http.post("/v1/chat/completions", json={
        "model": model_id, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1, "prompt_logprobs": 0,
    }).json()
    assert chat["prompt_logprobs"][0] is None and chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the prompt's own token alone
    plain = gateway_http.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_prompt_logprobs_out_of_range_are_refused(stub: Stub) -> None:
    import grpc

    request = generate(PROMPT, 1)
    request.sampling.prompt_logprobs = 21
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=60)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in str(refused.value)
    assert types_pb2.SamplingParams(prompt_logprobs=0).HasField("prompt_logprobs")
