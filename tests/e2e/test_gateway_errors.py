"""Every error status the gateway sends, each checked for OpenAI's exact JSON shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway
from tests.e2e.helpers import assert_error

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Hello"}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon who learns to paint."}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": HELLO, "temperature": 3}, "temperature"),
        ({"messages": HELLO, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"messages": HELLO, "n": 0}, "n"),
        ({"messages": HELLO, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": HELLO, "max_tokens": 10**6}, "max_tokens"),  # refused by the engine: over the context
        ({"messages": HELLO, "logit_bias": {"9999999": 1}}, "logit_bias"),  # refused by the engine: not in vocab
        ({"messages": HELLO, "stop_token_ids": [10**8]}, "stop_token_ids"),
        ({"messages": HELLO, "chat_template_kwargs": {"tools_in_user_message": True}}, "chat_template_kwargs"),
        ({"messages": HELLO, "regex": "(a", "max_tokens": 2}, "regex"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].image_url"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].input_audio"),
        ({"messages": [{"role": "user", "content": [{"type": "file"}]}]}, "messages[0].content[0].type"),
        # vLLM's extras that would change the answer and are not served: refused, never ignored.
        ({"messages": HELLO, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": HELLO, "documents": [{"text": 5}]}, "documents[0].text"),
        ({"messages": HELLO, "add_special_tokens": True}, "add_special_tokens"),
        ({"messages": HELLO, "logits_processors": ["x"]}, "logits_processors"),
        ({"messages": HELLO, "allowed_token_ids": [10**8]}, "allowed_token_ids"),  # refused by the engine
        # SGLang's extras that would change the answer and are not served.
        ({"messages": HELLO, "stop_regex": "a+"}, "stop_regex"),
        ({"messages": HELLO, "separate_reasoning": False}, "separate_reasoning"),
        ({"messages": HELLO, "stream_reasoning": False}, "stream_reasoning"),
        ({"messages": HELLO, "input_ids": [1, 2]}, "input_ids"),
        ({"messages": HELLO, "return_hidden_states": True}, "return_hidden_states"),
    ],
)
def test_400_names_the_param(gateway_http: httpx.Client, model_id: str, body: dict[str, Any], param: str) -> None:
    assert_error(gateway_http.post("/v1/chat/completions", json={"model": model_id, **body}), 400, param)


def test_400_for_bodies_that_are_not_json_objects(gateway_http: httpx.Client) -> None:
    raw = gateway_http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(raw, 400, None)
    assert_error(gateway_http.post("/v1/chat/completions", json=[1, 2]), 400, None)
    assert_error(gateway_http.post("/v1/completions", json={"model": "m"}), 400, "prompt")


def test_400_on_the_batched_endpoint(gateway_http: httpx.Client, model_id: str) -> None:
    route = "/v1/chat/completions/batch"
    base = {"model": model_id, "messages": [HELLO, HELLO]}
    assert_error(gateway_http.post(route, json={**base, "stream": True}), 400, "stream")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    unknown = {"type": "function", "function": {"name": "g"}}  # tools are taken; a choice of none of them is not
    assert_error(gateway_http.post(route, json={**base, "tools": tools, "tool_choice": unknown}), 400, "tool_choice")
    assert_error(gateway_http.post(route, json={**base, "use_beam_search": True}), 400, "use_beam_search")
    assert_error(gateway_http.post(route, json={**base, "n": 2}), 400, "n")
    over = gateway_http.post(route, json={**base, "max_tokens": 10**6})
    assert_error(over, 400, "max_tokens")


def test_404_unknown_model_and_route(gateway_http: httpx.Client) -> None:
    assert_error(gateway_http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": HELLO}), 404, "model",
                 "model_not_found")
    assert_error(gateway_http.get("/v1/models/gpt-9"), 404, "model", "model_not_found")
    assert_error(gateway_http.get("/v1/nothing-here"), 404, None)


def test_sdk_raises_its_typed_errors(openai_client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model=model_id, messages=[], max_tokens=2)  # type: ignore[arg-type]
    assert bad.value.param == "messages"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]


def test_401_with_an_api_key(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory, model_id: str) -> None:
    gateway = start_gateway(tmp_path_factory.mktemp("keyed") / "gateway.log", engine.address, "--api-key", "s3cret")
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            body = {"model": model_id, "messages": HELLO, "max_tokens": 2}
            assert_error(http.post("/v1/chat/completions", json=body), 401, None, "invalid_api_key")
            wrong = {"Authorization": "Bearer s3creT"}
            assert_error(http.post("/v1/chat/completions", json=body, headers=wrong), 401, None, "invalid_api_key")
            assert_error(http.get("/v1/models"), 401, None, "invalid_api_key")
            assert_error(http.get("/metrics"), 401, None, "invalid_api_key")
            assert http.get("/health").status_code == 200
        with openai.OpenAI(base_url=gateway.base_url, api_key="s3cret", max_retries=0) as client:
            assert client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=2).choices  # type: ignore[arg-type]
    finally:
        assert gateway.stop() == 0


def test_413_oversized_body_and_served_model_name(
    engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = start_gateway(tmp_path_factory.mktemp("small") / "gateway.log", engine.address,
                            "--max-request-mib", "0.01", "--served-model-name", "tiny-chat")
    try:
        assert httpx.get(gateway.url + "/v1/models", timeout=60).json()["data"][0]["id"] == "tiny-chat"
        big = {"model": "tiny-chat", "messages": [{"role": "user", "content": "x" * 20_000}]}
        assert_error(httpx.post(gateway.url + "/v1/chat/completions", json=big, timeout=60), 413, None,
                     "request_too_large")
        chunked = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                             content=iter([json.dumps(big).encode()]))  # no Content-Length: read and counted
        assert_error(chunked, 413, None, "request_too_large")
    finally:
        assert gateway.stop() == 0


def test_503_when_no_engine_is_ready(tmp_path_factory: pytest.TempPathFactory) -> None:
    dead = f"127.0.0.1:{free_port()}"
    gateway = start_gateway(tmp_path_factory.mktemp("dead") / "gateway.log", dead, wait_healthy=False)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            assert_error(http.get("/health"), 503, None, "engine_unavailable")
            body = {"model": "SmolLM2-135M-Instruct", "messages": HELLO}
            assert_error(http.post("/v1/chat/completions", json=body), 503, None, "engine_unavailable")
            assert_error(http.get("/v1/models"), 503, None, "engine_unavailable")
    finally:
        assert gateway.stop() == 0


@pytest.fixture(scope="module")
def tight_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One seat and one queue place at the engine; engine calls time out after 5 s at the gateway: long enough
    for the two 8-token requests the 429 test gets admitted on a loaded 2-core box, far too short for 4,000."""
    folder = tmp_path_factory.mktemp("tight")
    engine = start_engine(folder / "engine.log", "--max-num-seqs", "1", "--max-waiting", "1")
    gateway = start_gateway(folder / "gateway.log", engine.address, "--request-timeout", "5")
    yield gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0


def test_429_with_retry_after_when_the_engine_queue_is_full(tight_gateway: GatewayProcess) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "messages": LONG, "max_tokens": 8}
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(httpx.post(tight_gateway.url + "/v1/chat/completions", json=body, timeout=60))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if r.status_code == 429]
    assert refused, [r.status_code for r in results]
    for response in refused:
        assert_error(response, 429, None, "rate_limit_exceeded")
        assert response.headers["retry-after"] == "1"
    assert all(r.status_code in (200, 429) for r in results), [(r.status_code, r.text[:200]) for r in results]


def test_504_when_the_request_times_out(tight_gateway: GatewayProcess) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "messages": LONG, "max_tokens": 4000, "ignore_eos": True}
    assert_error(httpx.post(tight_gateway.url + "/v1/chat/completions", json=body, timeout=60), 504, None, "timeout")


def test_error_after_the_stream_started_is_an_error_event_without_done(tight_gateway: GatewayProcess) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "messages": LONG, "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", tight_gateway.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [e.removeprefix("data: ") for e in response.read().decode().split("\n\n") if e]
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert set(last) == {"error"} and last["error"]["code"] == "timeout"
    assert len(events) > 2  # content was streamed before the deadline passed
