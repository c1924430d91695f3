"""Traces across the gateway and the engine, received by a real OTLP collector endpoint (the collector's gRPC
TraceService, served in this process with the `opentelemetry-proto` messages): one chat request is a trace whose
gateway span is the parent of the engine's span, which has the request's phases as events; a client's
`traceparent` is continued; embeddings and score requests are traces into the engine's Embed and Score spans; a
batch line's engine span carries its batch id; trace ids appear in both processes' logs."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway

pytestmark = pytest.mark.slow

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, count: int, where: Any, timeout: float = 30) -> list[tuple[str, trace_pb2.Span]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [(service, span) for service, span in self.spans if where(service, span)]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind) if kind != "array_value" else None
    return values


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Collector, EngineProcess, GatewayProcess]]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    root = tmp_path_factory.mktemp("traces")
    previous = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s (the processes inherit it)
    try:
        engine = start_engine(root / "engine.log", "--otlp-traces-endpoint", endpoint)
        gateway = start_gateway(root / "gateway.log", engine.address, "--otlp-traces-endpoint", endpoint)
    finally:
        if previous is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = previous
    yield collector, engine, gateway
    assert gateway.stop() == 0
    assert engine.stop() == 0
    server.stop(None)


def chat(gateway: GatewayProcess, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
    reply = httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers or {}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def test_a_chat_request_is_one_trace_from_the_gateway_into_the_engine(
    traced: tuple[Collector, EngineProcess, GatewayProcess], model_id: str
) -> None:
    collector, _, gateway = traced
    reply = chat(gateway, model_id)
    request_id = reply.headers["x-request-id"]
    [(_, http_span)] = collector.wait_for(1, lambda s, span: s == "ladle-gateway"
                                          and attributes(span).get("ladle.request_id") == request_id)
    trace_id = http_span.trace_id
    found = collector.wait_for(1, lambda s, span: s == "ladle-engine" and span.trace_id == trace_id)
    [(_, engine_span)] = found
    assert http_span.name == "POST /v1/chat/completions" and http_span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert engine_span.name == "ladle.v1.EngineService/Generate"
    assert engine_span.parent_span_id == http_span.span_id  # the gateway's span is the engine span's parent
    usage = reply.json()["usage"]
    gateway_attributes, engine_attributes = attributes(http_span), attributes(engine_span)
    assert gateway_attributes["http.response.status_code"] == 200
    assert gateway_attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert engine_attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    events = [event.name for event in engine_span.events]
    assert events == ["queued", "scheduled", "first_token", "finished"], events
    times = [event.time_unix_nano for event in engine_span.events]
    assert times == sorted(times)
    trace_hex = trace_id.hex()
    assert trace_hex in gateway.log()  # the request's log line names its trace


@pytest.mark.parametrize(("route", "body", "rpc"), [
    ("/embeddings", {"input": ["Say hi.", "Say bye."]}, "Embed"),
    ("/score", {"text_1": "a colour", "text_2": ["red", "a dog"]}, "Score"),
])
def test_a_pooling_request_is_one_trace_from_the_gateway_into_the_engine(
    traced: tuple[Collector, EngineProcess, GatewayProcess], model_id: str, route: str, body: dict[str, Any],
    rpc: str,
) -> None:
    collector, _, gateway = traced
    reply = httpx.post(gateway.base_url + route, json={"model": model_id, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    request_id = reply.headers["x-request-id"]
    [(_, http_span)] = collector.wait_for(1, lambda s, span: s == "ladle-gateway"
                                          and attributes(span).get("ladle.request_id") == request_id)
    [(_, engine_span)] = collector.wait_for(1, lambda s, span: s == "ladle-engine"
                                            and span.trace_id == http_span.trace_id)
    assert engine_span.name == f"ladle.v1.EngineService/{rpc}"
    assert engine_span.parent_span_id == http_span.span_id
    assert attributes(engine_span)["gen_ai.usage.input_tokens"] == reply.json()["usage"]["prompt_tokens"] > 0


def test_a_clients_traceparent_is_continued(traced: tuple[Collector, EngineProcess, GatewayProcess],
                                            model_id: str) -> None:
    collector, _, gateway = traced
    chat(gateway, model_id, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
    spans = collector.wait_for(2, lambda s, span: span.trace_id.hex() == CLIENT_TRACE)
    by_service = {service: span for service, span in spans}
    assert by_service["ladle-gateway"].parent_span_id.hex() == CLIENT_PARENT
    assert by_service["ladle-engine"].parent_span_id == by_service["ladle-gateway"].span_id


def test_a_batch_lines_spans_carry_its_batch_id(traced: tuple[Collector, EngineProcess, GatewayProcess],
                                                model_id: str, tmp_path: Path) -> None:
    collector, _, gateway = traced
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model_id, "max_tokens": 2, "messages": [{"role": "user", "content": f"Hi {i}"}]}}
             for i in range(2)]
    upload = httpx.post(gateway.base_url + "/files", data={"purpose": "batch"}, timeout=60, files={
        "file": ("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode())}).json()
    batch = httpx.post(gateway.base_url + "/batches", timeout=60, json={
        "input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    items = collector.wait_for(2, lambda s, span: s == "ladle-engine" and span.name.endswith("Batch item")
                               and attributes(span).get("ladle.batch_id") == batch["id"], timeout=120)
    assert len(items) == 2
    [(_, batch_span)] = collector.wait_for(1, lambda s, span: s == "ladle-gateway" and span.name == "batch"
                                           and attributes(span).get("ladle.batch_id") == batch["id"])
    assert all(span.trace_id == batch_span.trace_id for _, span in items)
    assert all("first_token" in [e.name for e in span.events] for _, span in items)
