"""vLLM's `return_token_ids`, against the real engine on the embedded model: over gRPC
(`SamplingParams.return_prompt_token_ids`: Generate, and Stream's first message only) and through the gateway with
the official SDK's `extra_body`, as RL trainers send it: chat and completions, whole and streamed. The prompt's ids
are the engine's own tokenization of the input, the generated ones decode to the text, a streamed answer's chunks
carry the same ids as the whole one, and the ids sent back as a completions prompt continue the same way."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import httpx
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.helpers import chat_input, generate, stream, text_input

pytestmark = pytest.mark.slow

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub
QUESTION = "Name three colors of the rainbow."
PROMPT = "The capital of France is Paris, and the capital of Italy is"
IDS = {"return_token_ids": True}


def tokenized(stub: Stub, request: engine_pb2.TokenizeRequest) -> list[int]:
    return list(stub.Tokenize(request, timeout=10).token_ids)


def test_generate_and_stream_return_the_prompts_ids_when_asked(stub: Stub) -> None:
    ids = tokenized(stub, engine_pb2.TokenizeRequest(input=text_input(PROMPT)))
    request = generate(PROMPT, 4, return_prompt_token_ids=True)
    assert list(stub.Generate(request, timeout=60).prompt_token_ids) == ids
    assert list(stub.Generate(generate(PROMPT, 4), timeout=60).prompt_token_ids) == []
    messages = list(stub.Stream(stream(PROMPT, 4, return_prompt_token_ids=True), timeout=60))
    assert list(messages[0].prompt_token_ids) == ids and len(messages) > 1
    assert not any(m.prompt_token_ids for m in messages[1:])


def test_chat_returns_the_prompts_and_each_choices_ids(openai_client: openai.OpenAI, model_id: str,
                                                       stub: Stub) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    reply = openai_client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0,
                                                  n=2, extra_body=IDS)
    prompt_ids = reply.model_extra["prompt_token_ids"] if reply.model_extra else None
    assert prompt_ids == tokenized(stub, engine_pb2.TokenizeRequest(input=chat_input(QUESTION)))
    assert reply.usage is not None and len(prompt_ids) == reply.usage.prompt_tokens
    generated = [choice.model_extra["token_ids"] for choice in reply.choices if choice.model_extra]
    assert len(generated) == 2 and sum(map(len, generated)) == reply.usage.completion_tokens
    for choice, ids in zip(reply.choices, generated, strict=True):
        decoded = stub.Detokenize(engine_pb2.DetokenizeRequest(token_ids=ids), timeout=10).text
        assert decoded == choice.message.content
    plain = openai_client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0)
    assert "prompt_token_ids" not in (plain.model_extra or {})
    assert "token_ids" not in (plain.choices[0].model_extra or {})

    # Streamed: the prompt's ids on the first chunk alone, the chunks' ids joined the whole answer's.
    chunks = list(openai_client.chat.completions.create(model=model_id, messages=messages, max_tokens=12,
                                                        temperature=0, stream=True, extra_body=IDS))
    firsts = [(chunk.model_extra or {}).get("prompt_token_ids", "absent") for chunk in chunks]
    assert firsts[0] == prompt_ids and set(firsts[1:]) == {"absent"}
    streamed = [i for chunk in chunks for choice in chunk.choices for i in (choice.model_extra or {}).get(
        "token_ids") or []]
    assert streamed == generated[0]


def test_the_batched_chat_route_puts_each_conversations_ids_on_its_choice(gateway_http: httpx.Client, model_id: str,
                                                                         stub: Stub) -> None:
    """`/v1/chat/completions/batch`: one choice per conversation, each with its prompt's ids, its generated ones (those
    of the same conversation sent alone) and, asked for, its prompt's log-probabilities."""
    questions = [QUESTION, "What is two plus two?"]
    body = {"model": model_id, "messages": [[{"role": "user", "content": q}] for q in questions], "max_tokens": 6,
            "temperature": 0, "prompt_logprobs": 0, **IDS}
    reply = gateway_http.post("/v1/chat/completions/batch", json=body)
    assert reply.status_code == 200, reply.text
    for question, choice in zip(questions, reply.json()["choices"], strict=True):
        ids = tokenized(stub, engine_pb2.TokenizeRequest(input=chat_input(question)))
        assert choice["prompt_token_ids"] == ids and len(choice["prompt_logprobs"]) == len(ids)
        alone = gateway_http.post("/v1/chat/completions", json={
            "model": model_id, "messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": 0,
            **IDS}).json()["choices"][0]
        assert choice["token_ids"] == alone["token_ids"] and choice["message"]["content"] == alone["message"]["content"]


def test_completions_return_ids_whole_streamed_and_as_a_prompt(gateway_http: httpx.Client, model_id: str,
                                                               stub: Stub) -> None:
    ids = tokenized(stub, engine_pb2.TokenizeRequest(input=text_input(PROMPT)))
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **IDS}
    whole = gateway_http.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    # The ids as the prompt (token in, token out, as an RL trainer continues a rollout): the same continuation.
    again = gateway_http.post("/v1/completions", json={**body, "prompt": ids}).json()["choices"][0]
    assert again["token_ids"] == choice["token_ids"] and again["text"] == choice["text"]

    events = _sse(gateway_http, {**body, "stream": True, "echo": True})
    choices = [c for event in events for c in event["choices"]]
    assert choices[0]["prompt_token_ids"] == ids and not any("prompt_token_ids" in c for c in choices[1:])
    assert [i for c in choices for i in c.get("token_ids", [])] == choice["token_ids"]
    assert "".join(c["text"] for c in choices) == PROMPT + choice["text"]

    nothing = gateway_http.post("/v1/completions", json={**body, "max_tokens": 0, "echo": True}).json()
    assert nothing["choices"][0]["prompt_token_ids"] == ids and nothing["choices"][0]["token_ids"] == []


def test_logprobs_name_their_tokens_by_id_when_asked(gateway_http: httpx.Client, model_id: str, stub: Stub) -> None:
    """vLLM's `return_tokens_as_token_ids`: each logprobs entry's token and its alternatives as "token_id:<id>" (the
    chat's content, whole and streamed; the completions' lists, the echoed prompt's too), the numbers and the text
    offsets as without it."""
    chat = {"model": model_id, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, **IDS}
    plain = gateway_http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    named = gateway_http.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True}).json()
    choice = named["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    assert [e["logprob"] for e in entries] == [e["logprob"] for e in plain["logprobs"]["content"]]
    with gateway_http.stream("POST", "/v1/chat/completions",
                             json={**chat, "stream": True, "return_tokens_as_token_ids": True}) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    streamed = [e["token"] for ev in events for c in ev["choices"]
                for e in (c.get("logprobs") or {}).get("content", [])]  # fmt: skip
    assert streamed == [e["token"] for e in entries]

    ids = tokenized(stub, engine_pb2.TokenizeRequest(input=text_input(PROMPT)))
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    as_text = gateway_http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    as_ids = gateway_http.post("/v1/completions", json={**body, **IDS, "return_tokens_as_token_ids": True}).json()
    logprobs = as_ids["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{i}" for i in ids + as_ids["choices"][0]["token_ids"]]
    assert logprobs["text_offset"] == as_text["text_offset"]
    assert all(next(iter(top)).startswith("token_id:") for top in logprobs["top_logprobs"][1:])


def _sse(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]
