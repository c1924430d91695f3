"""Cancellation frees a request's KV blocks at once; a deadline that passes in the queue means it never runs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TypeAlias

import grpc
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.helpers import generate, stream

Stub: TypeAlias = engine_pb2_grpc.EngineServiceStub
LONG_PROMPT = "Write a very long story about a dragon who learns to paint. " * 4


def _load(stub: Stub) -> engine_pb2.GetLoadResponse:
    return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)


def test_cancelled_stream_is_aborted_and_its_blocks_freed_within_1s(stub: Stub) -> None:
    baseline = _load(stub)
    assert baseline.running == 0 and baseline.waiting == 0
    call = stub.Stream(stream(LONG_PROMPT, 2000, ignore_eos=True), timeout=120)
    responses = iter(call)
    for _ in range(3):
        next(responses)
    busy = _load(stub)
    assert busy.running == 1 and busy.kv_blocks_used > baseline.kv_blocks_used

    call.cancel()
    cancelled_at = time.monotonic()
    while True:
        load = _load(stub)
        # Prefix-cached blocks may stay cached, but they must be free: compare blocks in use.
        if (load.running, load.waiting, load.kv_blocks_used) == (0, 0, baseline.kv_blocks_used):
            break
        assert time.monotonic() - cancelled_at < 1.0, f"still busy 1 s after the cancel: {load}"
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as failure:
        next(responses)
    assert failure.value.code() == grpc.StatusCode.CANCELLED
    assert stub.Generate(generate("Still serving?", 2), timeout=30).choices[0].token_ids


@pytest.fixture(scope="module")
def one_seat_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """An engine that runs one sequence at a time, so a second request has to queue."""
    process = start_engine(tmp_path_factory.mktemp("one-seat") / "engine.log", "--max-num-seqs", "1")
    yield process
    assert process.stop() == 0


def _finished_line(log: str, request_id: str) -> dict[str, object] | None:
    for line in log.splitlines():
        if line.startswith("{"):
            record: dict[str, object] = json.loads(line)
            if record.get("event") == "request finished" and record.get("request_id") == request_id:
                return record
    return None


def test_deadline_expiring_in_the_queue_is_deadline_exceeded_and_never_runs(one_seat_engine: EngineProcess) -> None:
    with grpc.insecure_channel(one_seat_engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        hog = stub.Stream(stream(LONG_PROMPT, 2000, ignore_eos=True), timeout=120)
        next(iter(hog))  # the only seat is taken
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            stub.Generate(generate("Queued behind the hog", 4, request_id="queued-probe"), timeout=0.8)
        assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5.0
        assert _load(stub).running == 1  # the hog is still the one running
        hog.cancel()

        deadline = time.monotonic() + 10
        while (record := _finished_line(one_seat_engine.log(), "queued-probe")) is None:
            assert time.monotonic() < deadline, "the engine never logged the queued request's end"
            time.sleep(0.1)
        assert record["ran"] is False and record["completion_tokens"] == 0, record
        assert stub.Generate(generate("After the hog", 2), timeout=60).choices[0].token_ids

