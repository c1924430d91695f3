"""SGLang's native `POST /generate` against real `ladle gateway` + `ladle engine` processes, with the requests SGLang's
own docs send (its "Sending Requests" and "Sampling Parameters" pages: a text prompt greedy, then streamed and read
as their loop reads it), batches, token ids, n, logprobs, stops and the refusals."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
DOCS_EXAMPLE = {"text": FRANCE, "sampling_params": {"temperature": 0, "max_new_tokens": 32}}


def engine_greedy(stub: engine_pb2_grpc.EngineServiceStub, prompt: str, tokens: int) -> engine_pb2.GenerateResponse:
    return stub.Generate(engine_pb2.GenerateRequest(
        input=types_pb2.Input(text=prompt), sampling=types_pb2.SamplingParams(max_tokens=tokens, temperature=0),
    ), timeout=120)  # fmt: skip


def test_the_docs_example_answers_the_engines_greedy_text(
    gateway_http: httpx.Client, stub: engine_pb2_grpc.EngineServiceStub
) -> None:
    reply = gateway_http.post("/generate", json=DOCS_EXAMPLE)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    engine = engine_greedy(stub, FRANCE, 32)
    assert out["text"] == engine.choices[0].text
    assert out["output_ids"] == list(engine.choices[0].token_ids)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == engine.usage.prompt_tokens
    assert meta["completion_tokens"] == len(out["output_ids"]) == engine.usage.completion_tokens
    ended = ({"type": "length", "length": 32}, {"type": "stop", "matched": out["output_ids"][-1]})
    assert meta["finish_reason"] in ended
    assert isinstance(meta["id"], str) and meta["id"] and meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0


def test_the_docs_streaming_loop_reads_the_whole_text(gateway_http: httpx.Client) -> None:
    """SGLang's documented loop: each `data:` event's text is the text so far; `data: [DONE]` ends the stream."""
    whole = gateway_http.post("/generate", json=DOCS_EXAMPLE).json()
    printed, prev, events = "", 0, []
    with gateway_http.stream("POST", "/generate", json={**DOCS_EXAMPLE, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data:")
        data = json.loads(line[5:].strip("\n"))
        events.append(data)
        output = data["text"]
        printed += output[prev:]
        prev = len(output)
    assert printed == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert "index" not in events[-1]


def test_batches_token_ids_and_n(gateway_http: httpx.Client, stub: engine_pb2_grpc.EngineServiceStub) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 8}
    batch = gateway_http.post("/generate", json={"text": [FRANCE, "Once upon a time"], "sampling_params": greedy})
    outs = batch.json()
    prompts = (FRANCE, "Once upon a time")
    assert [o["text"] for o in outs] == [engine_greedy(stub, p, 8).choices[0].text for p in prompts]
    ids = list(stub.Tokenize(engine_pb2.TokenizeRequest(input=types_pb2.Input(text=FRANCE)), timeout=60).token_ids)
    by_ids = gateway_http.post("/generate", json={"input_ids": ids, "sampling_params": greedy}).json()
    assert by_ids["text"] == outs[0]["text"]
    two = gateway_http.post("/generate", json={"input_ids": [ids, ids], "sampling_params": [greedy, {
        **greedy, "max_new_tokens": 4}], "rid": ["a", "b"]}).json()  # fmt: skip
    assert [o["meta_info"]["id"] for o in two] == ["a", "b"] and len(two[1]["output_ids"]) <= 4
    sampled = gateway_http.post("/generate", json={"text": FRANCE, "sampling_params": {
        "n": 3, "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 4}}).json()  # fmt: skip
    assert isinstance(sampled, list) and len(sampled) == 3 and len({o["text"] for o in sampled}) > 1
    with gateway_http.stream("POST", "/generate", json={"text": [FRANCE, "Hi"], "sampling_params": greedy,
                                                         "stream": True}) as response:  # fmt: skip
        events = [json.loads(line[5:]) for line in response.iter_lines() if line and line != "data: [DONE]"]
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1] and last[0]["text"] == outs[0]["text"]


def test_logprobs_and_stops(gateway_http: httpx.Client) -> None:
    body: dict[str, Any] = {"text": FRANCE, "sampling_params": {"temperature": 0, "max_new_tokens": 6},
                            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
                            "return_text_in_logprobs": True}  # fmt: skip
    out = gateway_http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(entry[0], float) and isinstance(entry[2], str) for entry in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None and all(e[0] <= 0 for e in inputs[1:])
    assert meta["input_top_logprobs"][0] is None
    plain = gateway_http.post("/generate", json={**body, "return_text_in_logprobs": False, "logprob_start_len": 2})
    plain_meta = plain.json()["meta_info"]
    assert plain_meta["output_token_logprobs"][0][2] is None and len(plain_meta["input_token_logprobs"]) == len(
        inputs) - 2  # fmt: skip
    word = out["text"].split()[0]
    stopped = gateway_http.post("/generate", json={"text": FRANCE, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "stop": word}}).json()  # fmt: skip
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    kept = gateway_http.post("/generate", json={"text": FRANCE, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "stop": [word], "no_stop_trim": True}}).json()  # fmt: skip
    assert kept["text"].endswith(word) and not stopped["text"].endswith(word)
    for key, value in (("regex", "(yes|no)"), ("ebnf", 'root ::= "yes" | "no"'), ("json_schema", json.dumps(
            {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}))):
        constrained = gateway_http.post("/generate", json={"text": FRANCE, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, key: value}}).json()  # fmt: skip
        text = constrained["text"]
        assert text in ("yes", "no") if key != "json_schema" else isinstance(json.loads(text)["a"], bool), text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": FRANCE, "input_ids": [1, 2]}, "text"),
        ({}, "text"),
        ({"text": FRANCE, "sampling_params": {"max_new_token": 4}}, "sampling_params.max_new_token"),
        ({"text": FRANCE, "sampling_params": {"temperature": 9}}, "sampling_params.temperature"),
        ({"text": FRANCE, "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ({"text": FRANCE, "image_data": "cat.png"}, "image_data"),
        ({"text": FRANCE, "sampling_params": [{}, {}]}, "sampling_params"),
        ({"text": FRANCE, "top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num"),
        ({"text": FRANCE, "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
        ({"text": "a\ud800b"}, None),  # a lone surrogate: a 400, not protobuf's encoding error
        ({"input_ids": []}, "input_ids"),
        ({"text": FRANCE, "lora_path": "no-such-adapter"}, "model"),
    ],
)
def test_what_generate_refuses_is_a_400_naming_it(
    gateway_http: httpx.Client, body: dict[str, Any], param: str | None
) -> None:
    raw = json.dumps(body).encode()  # (json.dumps keeps a lone surrogate as its \ud800 escape)
    reply = gateway_http.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == (404 if param == "model" else 400), reply.text
    assert reply.json()["error"]["param"] == param
