"""What the SDK hides: the raw SSE framing, request ids in headers and logs, /metrics, /health, and that a client
disconnecting from a stream makes the engine abort the request within 1 s."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "temperature": 0}


def _events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = [block for block in body.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


def test_sse_framing_role_content_finish_usage_done(gateway_http: httpx.Client, model_id: str) -> None:
    body = {**CHAT, "model": model_id, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    with gateway_http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_request_id_is_echoed_and_logged(gateway_http: httpx.Client, gateway: GatewayProcess, model_id: str) -> None:
    reply = gateway_http.post("/v1/chat/completions", json={**CHAT, "model": model_id, "max_tokens": 2},
                              headers={"X-Request-Id": "trace-abc-123"})
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == "trace-abc-123"
    assert reply.json()["id"].startswith("chatcmpl-trace-abc-123-")  # unique per call, the caller's id first
    generated = gateway_http.get("/v1/models").headers["x-request-id"]
    assert len(generated) == 32
    bad = gateway_http.post("/v1/chat/completions", json={"model": model_id, "messages": []},
                            headers={"X-Request-Id": "trace-bad-1"})
    assert bad.status_code == 400
    deadline = time.monotonic() + 5
    while '"request_id": "trace-bad-1"' not in gateway.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith("{")]
    assert any(line.get("request_id") == "trace-bad-1" for line in lines)


def test_two_concurrent_calls_with_one_request_id_both_succeed(gateway: GatewayProcess, model_id: str) -> None:
    """A client's X-Request-Id names its trace, not the engine request: two calls that send the same one at the
    same time are two requests, each answered, each echoing the id."""
    body = {**CHAT, "model": model_id, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    def call(stream: bool) -> tuple[int, str, str]:
        with httpx.Client(base_url=gateway.url, timeout=120) as client:
            reply = client.post("/v1/chat/completions", json={**body, "stream": stream},
                                headers={"X-Request-Id": "same-id-7"})
            first = reply.text.split("\n", 1)[0] if stream else reply.json()["id"]
            return reply.status_code, reply.headers["x-request-id"], first

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(call, [True, False] * 4))
    assert [r[:2] for r in replies] == [(200, "same-id-7")] * 8, replies
    assert len({r[2] for r in replies[1::2]}) == 4  # four completions, four ids


def test_metrics_and_health(gateway_http: httpx.Client, model_id: str) -> None:
    gateway_http.post("/v1/chat/completions", json={**CHAT, "model": model_id, "max_tokens": 3, "stream": True})
    health = gateway_http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    time.sleep(1.2)  # one engine poll, so the engine gauges are fresh
    text = gateway_http.get("/metrics").text
    assert 'ladle_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    for name in ("ladle_gateway_time_to_first_token_seconds_count", "ladle_gateway_inter_token_latency_seconds_count",
                 "ladle_gateway_request_latency_seconds_count", "ladle_gateway_completion_tokens_total",
                 "ladle_gateway_prompt_tokens_total", "ladle_gateway_requests_in_flight", "ladle_engine_up",
                 "ladle_engine_running", "ladle_engine_waiting", "ladle_engine_kv_cache_usage"):
        assert name in text, name


def test_client_disconnect_aborts_the_engine_request_within_1s(
    gateway_http: httpx.Client, model_id: str, stub: engine_pb2_grpc.EngineServiceStub
) -> None:
    def load() -> engine_pb2.GetLoadResponse:
        return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)

    baseline = load()
    assert baseline.running == 0
    body = {**CHAT, "model": model_id, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with gateway_http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert load().running == 1
    closed_at = time.monotonic()
    while True:
        now = load()
        if (now.running, now.waiting, now.kv_blocks_used) == (0, 0, baseline.kv_blocks_used):
            break
        assert time.monotonic() - closed_at < 1.0, f"still running 1 s after the client left: {now}"
        time.sleep(0.02)


def test_routes_around_an_engine_that_is_down(
    engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory, model_id: str
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    gateway = start_gateway(tmp_path_factory.mktemp("two") / "gateway.log", f"{dead},{engine.address}")
    try:
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            assert http.get("/health").json()["engines"] == [engine.address]
            body = {**CHAT, "model": model_id, "max_tokens": 2}
            assert all(http.post("/v1/chat/completions", json=body).status_code == 200 for _ in range(4))
            metrics = http.get("/metrics").text
            assert f'ladle_engine_up{{engine="{dead}"}} 0.0' in metrics
            assert f'ladle_engine_up{{engine="{engine.address}"}} 1.0' in metrics
    finally:
        assert gateway.stop() == 0
