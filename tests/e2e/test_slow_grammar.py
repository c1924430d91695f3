"""A constraint that takes too long to compile fails alone, within the engine's limit, while 16 concurrent
streams keep producing tokens: compilation never holds up the step loop."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.helpers import chat_input, sampling, stream

pytestmark = pytest.mark.slow

# xgrammar's compile time grows with each distinct bounded string: one of ~5000 characters takes ~0.9 s on the
# 2-core Xeon VM (~3 s on the Zen 3 one, and a CI machine once compiled it inside 0.25 s), eight distinct ones
# ~6.6 s. Eight keep the compile well past the limit on a fast CPU too.
LIMIT_S = 0.25
SLOW_SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "string", "minLength": 1, "maxLength": 5000 + i} for i, key in enumerate("abcdefgh")},
    "required": list("abcdefgh"),
}


@pytest.fixture(scope="module")
def limited_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = start_engine(tmp_path_factory.mktemp("slow-grammar") / "engine.log", "--max-num-seqs", "16",
                           "--grammar-timeout", str(LIMIT_S))
    yield process
    assert process.stop() == 0


def test_a_slow_schema_fails_alone_while_16_streams_keep_going(limited_engine: EngineProcess) -> None:
    with grpc.insecure_channel(limited_engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        arrivals: list[list[float]] = [[] for _ in range(16)]
        calls = [stub.Stream(stream(f"Story number {i}:", 4000, ignore_eos=True), timeout=300) for i in range(16)]

        def read(i: int) -> None:
            try:
                for _ in calls[i]:
                    arrivals[i].append(time.monotonic())
            except grpc.RpcError:
                pass  # cancelled at the end of the test

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(16)]
        for reader in readers:
            reader.start()
        while not all(arrivals):  # every stream is producing
            time.sleep(0.05)

        slow = engine_pb2.GenerateRequest(
            input=chat_input("Say something."), sampling=sampling(16),
            constraint=types_pb2.Constraint(json_schema=json.dumps(SLOW_SCHEMA)),
        )
        submitted = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            stub.Generate(slow, timeout=20)  # admitted by mistake, it would wait for a slot
        failed = time.monotonic()
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"did not compile within {LIMIT_S:g} s" in (failure.value.details() or "")
        assert LIMIT_S <= failed - submitted < LIMIT_S + 2.0

        for i, times in enumerate(arrivals):  # each stream got tokens while the grammar was compiling...
            assert any(submitted < t < failed for t in times), f"stream {i} stalled during the compile"
        # ...and goes on after it (the abandoned compile may still hold the CPU for a while, so allow time).
        deadline = time.monotonic() + 30
        while not all(times[-1] > failed for times in arrivals) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(times[-1] > failed for times in arrivals), "a stream stopped after the compile failed"
        for call in calls:
            call.cancel()
        for reader in readers:
            reader.join(10)
