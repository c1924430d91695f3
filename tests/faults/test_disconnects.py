"""Clients that go away mid-stream, and more clients than the engine admits.

- 1,000 streams (half gRPC to the engine, half SSE through the gateway) each dropped at a random point after
  their first chunk: the engine ends every one (its "request finished" log line, stamped with the host's
  monotonic clock, against the moment the client hung up: p99 under 1 s), and afterwards no KV block is left
  in use (GetLoad against the idle baseline).
- Twice the engine's capacity (seats + queue) at once: the overflow is refused at once, RESOURCE_EXHAUSTED over
  gRPC and 429 with Retry-After over HTTP, the rest completes, and no call hangs.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.e2e.helpers import generate, stream

pytestmark = pytest.mark.slow

DISCONNECTS_PER_PROTOCOL = 500
CLIENT_THREADS = 16
ABORT_P99_LIMIT_S = 1.0
_thread_state = threading.local()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A toy model: what a disconnect costs here is the engine computing the stream's prompt and first tokens
    (the embedded model's ~40 ms of CPU apiece made the engine the bottleneck of the 1,000), not the abort."""
    process = start_engine(tmp_path_factory.mktemp("disconnects") / "engine.log", "--model", "dummy:qwen2-tiny",
                           "--max-num-seqs", "32")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def gateway(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(tmp_path_factory.mktemp("disconnects-gateway") / "gateway.log", engine.address)
    yield process
    assert process.stop() == 0


def load(stub: engine_pb2_grpc.EngineServiceStub) -> engine_pb2.GetLoadResponse:
    return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)


def drop_grpc_stream(stub: engine_pb2_grpc.EngineServiceStub, request_id: str, chunks: int) -> float:
    """Open a long stream, read `chunks` responses, cancel; returns the monotonic time of the cancel."""
    call = stub.Stream(stream(f"Story {request_id}: once upon a time", 2000, request_id=request_id,
                              ignore_eos=True), timeout=120)
    responses = iter(call)
    for _ in range(chunks):
        next(responses)
    hung_up = time.monotonic()
    call.cancel()
    return hung_up


def drop_http_stream(base_url: str, model: str, request_id: str, chunks: int) -> float:
    """Open a long SSE chat stream, read `chunks` events, close the connection; returns when it hung up."""
    client: httpx.Client = getattr(_thread_state, "client", None) or httpx.Client(base_url=base_url, timeout=120)
    _thread_state.client = client
    body = {"model": model, "messages": [{"role": "user", "content": f"Story {request_id}"}], "stream": True,
            "max_tokens": 2000, "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}) as reply:
        assert reply.status_code == 200, reply.read()
        events = (line for line in reply.iter_lines() if line.startswith("data: "))
        for _ in range(chunks):
            next(events)
        hung_up = time.monotonic()
    return hung_up  # leaving the block closed the unfinished response, and with it the connection


_CALL_SUFFIX = re.compile(r"^(drop-http-\d+)-[0-9a-f]{8}$")


def finished_at(log: str) -> dict[str, tuple[str, float]]:
    """request_id -> (outcome, monotonic time) of each "request finished" line of an engine's JSON log."""
    ends: dict[str, tuple[str, float]] = {}
    for line in log.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == "request finished":
                # Through the gateway the engine's id is the caller's X-Request-Id plus a per-call suffix.
                request_id = _CALL_SUFFIX.sub(r"\1", record["request_id"])
                ends[request_id] = (record["outcome"], record["at"])
    return ends


def test_1000_random_disconnects_abort_fast_and_leak_no_blocks(
    engine: EngineProcess, gateway: GatewayProcess
) -> None:
    rng = random.Random(1000)
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        assert stub.Generate(generate("Warm the prefix cache", 2), timeout=60).choices[0].token_ids
        baseline = load(stub)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"][0]["id"]
        jobs = [("grpc", f"drop-grpc-{i}", rng.randint(1, 4)) for i in range(DISCONNECTS_PER_PROTOCOL)]
        jobs += [("http", f"drop-http-{i}", rng.randint(1, 4)) for i in range(DISCONNECTS_PER_PROTOCOL)]
        rng.shuffle(jobs)

        def run(job: tuple[str, str, int]) -> tuple[str, float]:
            kind, request_id, chunks = job
            if kind == "grpc":
                return request_id, drop_grpc_stream(stub, request_id, chunks)
            return request_id, drop_http_stream(gateway.url, model, request_id, chunks)

        started = time.monotonic()
        with ThreadPoolExecutor(CLIENT_THREADS) as pool:
            hung_up = dict(pool.map(run, jobs))
        elapsed = time.monotonic() - started

        deadline = time.monotonic() + 10
        while (after := load(stub)).running or after.waiting or after.kv_blocks_used != baseline.kv_blocks_used:
            assert time.monotonic() < deadline, f"not idle 10 s after the last disconnect: {after} vs {baseline}"
            time.sleep(0.05)
        assert stub.Generate(generate("Still serving?", 4), timeout=60).choices[0].token_ids

    time.sleep(0.5)  # the log lines of the last aborts
    ends = finished_at(engine.log())
    missing = sorted(set(hung_up) - set(ends))
    assert not missing, f"{len(missing)} dropped requests never ended in the engine, e.g. {missing[:5]}"
    assert all(ends[request_id][0] != "finished" for request_id in hung_up)  # aborted, not run to the end
    lags = sorted(ends[request_id][1] - hung_up[request_id] for request_id in hung_up)
    p50, p99 = statistics.median(lags), lags[int(0.99 * (len(lags) - 1))]
    print(f"{len(lags)} disconnects in {elapsed:.1f} s: abort lag p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms,"
          f" max {lags[-1] * 1000:.0f} ms; KV blocks in use after: {after.kv_blocks_used}"
          f" (idle baseline {baseline.kv_blocks_used})")
    assert p99 < ABORT_P99_LIMIT_S


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """2 seats and a queue of 2: a capacity of 4 requests."""
    process = start_engine(tmp_path_factory.mktemp("overflow") / "engine.log", "--max-num-seqs", "2",
                           "--max-waiting", "2")
    yield process
    assert process.stop() == 0


def test_twice_the_capacity_over_grpc_is_resource_exhausted(small_engine: EngineProcess) -> None:
    with grpc.insecure_channel(small_engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        def call(i: int) -> grpc.StatusCode:
            try:
                stub.Generate(generate(f"Count to ten, take {i}.", 48, ignore_eos=True), timeout=120)
            except grpc.RpcError as error:
                assert error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "retry" in (error.details() or "")
                return error.code()
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(call, range(8)))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    # Admission counts the queue only (max_waiting): 2 are always admitted; whether the 2 seats fill before the
    # others arrive depends on when the step loop takes the first ones off the queue.
    assert codes.count(grpc.StatusCode.OK) >= 2 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes


def test_twice_the_capacity_over_http_is_429_with_retry_after(
    small_engine: EngineProcess, tmp_path: Path
) -> None:
    gateway = start_gateway(tmp_path / "gateway.log", small_engine.address)
    try:
        with httpx.Client(base_url=gateway.url, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]

            def call(i: int) -> httpx.Response:
                body = {"model": model, "messages": [{"role": "user", "content": f"Count to ten, take {i}."}],
                        "max_tokens": 48, "ignore_eos": True}
                return client.post("/v1/chat/completions", json=body)

            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(call, range(8)))
        statuses = [reply.status_code for reply in replies]
        assert set(statuses) <= {200, 429}, [reply.text for reply in replies]
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses  # as over gRPC, above
        for reply in replies:
            if reply.status_code == 429:
                assert int(reply.headers["Retry-After"]) >= 1
                error = reply.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded"), error
    finally:
        assert gateway.stop() == 0
