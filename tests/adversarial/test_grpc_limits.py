"""The engine's gRPC edge under attack: a message over the size limit, a Batch call of 10,000 items, and a Batch
client that stops reading (the engine stops taking its items, keeps serving others, and holds no more than its
window)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.adversarial.helpers import assert_rpc_error, rpc_error, still_serves_grpc
from tests.e2e.engine_process import EngineProcess
from tests.e2e.helpers import generate

pytestmark = pytest.mark.slow

Stub = engine_pb2_grpc.EngineServiceStub
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # engine_server.server.server.MAX_MESSAGE_BYTES
MAX_PULLED = 5_000  # of 10,000 items: what a client that reads nothing can push before flow control stops it
WINDOW = 2 * 32  # a Batch call has at most twice the engine's max_num_seqs (32 here) items unfinished or unsent


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def load(stub: Stub) -> engine_pb2.GetLoadResponse:
    reply: engine_pb2.GetLoadResponse = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    return reply


def wait_idle(stub: Stub, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := load(stub)).running + now.waiting and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (now.running, now.waiting, now.kv_blocks_used) == (0, 0, 0), now


def test_a_message_over_the_size_limit(stub: Stub) -> None:
    huge = generate("x" * (MAX_MESSAGE_BYTES + 1024 * 1024), 2)
    error = rpc_error(stub.Generate, huge, timeout=60)
    assert_rpc_error(error, grpc.StatusCode.RESOURCE_EXHAUSTED, None, "Received message larger than max")
    assert f"vs. {MAX_MESSAGE_BYTES})" in (error.details() or "")
    items = iter([engine_pb2.BatchRequest(item_id="0", request=generate("Hi", 1)),
                  engine_pb2.BatchRequest(item_id="1", request=huge)])
    batch = rpc_error(lambda: list(stub.Batch(items, timeout=60)))
    assert_rpc_error(batch, grpc.StatusCode.RESOURCE_EXHAUSTED, None, "Received message larger than max")
    still_serves_grpc(stub)


def test_batch_with_10000_items(stub: Stub) -> None:
    """Every item is answered once, under its own id, while the engine holds at most its window. One item in two
    hundred generates; the rest are refused one by one (no input) without ending the call — ten thousand
    generations would take this CPU minutes."""

    def items() -> Iterator[engine_pb2.BatchRequest]:
        for i in range(10_000):
            request = generate(f"Item {i}:", 1) if i % 200 == 0 else engine_pb2.GenerateRequest()
            yield engine_pb2.BatchRequest(item_id=str(i), request=request)

    seen: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    peak = 0
    for position, response in enumerate(stub.Batch(items(), timeout=300)):
        seen[response.item_id] += 1
        outcomes[response.WhichOneof("outcome")] += 1
        if response.HasField("error"):
            assert (response.error.code, response.error.param) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "input")
            assert response.error.message == "input must set one of text, chat, token_ids or transcription"
        else:
            assert int(response.item_id) % 200 == 0 and len(response.result.choices[0].token_ids) == 1
        if position % 500 == 0:
            now = load(stub)
            peak = max(peak, now.running + now.waiting)
    assert set(seen) == {str(i) for i in range(10_000)} and set(seen.values()) == {1}
    assert outcomes == {"error": 9_950, "result": 50}
    assert peak <= WINDOW
    wait_idle(stub)
    still_serves_grpc(stub)


def test_batch_with_a_client_that_stops_reading(stub: Stub, engine: EngineProcess) -> None:
    """The client sends 10,000 items of 16 KiB each (160 MiB) and reads nothing: the engine takes no more than
    its window plus what the transport buffers (HTTP/2 windows, socket buffers, the client's own send queue:
    seen between ~1,500 and ~3,200 items, by timing), serves other callers meanwhile, and drops everything once
    the client goes away. An engine that read without bound would take all 10,000 within seconds."""
    pulled = 0
    padding = "x" * 16 * 1024  # in the request id, which costs the model nothing

    def items() -> Iterator[engine_pb2.BatchRequest]:
        nonlocal pulled
        for i in range(10_000):
            pulled += 1
            yield engine_pb2.BatchRequest(item_id=str(i), request=generate("Hi", 1, request_id=f"{i}-{padding}"))

    rss_before = rss_bytes(engine.process.pid)
    call = stub.Batch(items(), timeout=300)
    try:
        settled, last = time.monotonic(), -1
        while time.monotonic() - settled < 3.0:  # until the client can push no more
            time.sleep(0.5)
            if pulled != last:
                settled, last = time.monotonic(), pulled
        assert pulled < MAX_PULLED, f"the engine took {pulled} items from a client that reads nothing"
        now = load(stub)
        assert now.running + now.waiting <= WINDOW
        still_serves_grpc(stub)  # other callers are served while the batch is stalled
        assert rss_bytes(engine.process.pid) - rss_before < 256 * 1024 * 1024
        assert pulled < MAX_PULLED  # still bounded after the stall went on
    finally:
        call.cancel()
    wait_idle(stub)
    still_serves_grpc(stub)
