"""SIGTERM drains: health turns NOT_SERVING, new calls get UNAVAILABLE, streams in flight finish, exit 0."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import start_engine
from tests.e2e.helpers import generate, joined_stream, stream

NUM_STREAMS = 8
MAX_TOKENS = 40


def test_sigterm_with_8_streams_in_flight(tmp_path_factory: pytest.TempPathFactory) -> None:
    engine = start_engine(tmp_path_factory.mktemp("drain") / "engine.log", "--max-num-seqs", "8")
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            calls = [
                stub.Stream(stream(f"Story number {i}: once upon a time", MAX_TOKENS, ignore_eos=True), timeout=120)
                for i in range(NUM_STREAMS)
            ]
            iterators = [iter(call) for call in calls]
            firsts = [next(it) for it in iterators]  # every stream is running
            results: dict[int, list[engine_pb2.StreamResponse]] = {}
            errors: list[BaseException] = []

            def drain(i: int) -> None:
                try:
                    results[i] = [firsts[i], *iterators[i]]
                except BaseException as exc:
                    errors.append(exc)

            readers = [threading.Thread(target=drain, args=(i,)) for i in range(NUM_STREAMS)]
            for reader in readers:
                reader.start()

            engine.process.send_signal(signal.SIGTERM)

            refused_at = time.monotonic() + 5
            while True:  # the signal lands asynchronously: soon every new call is refused
                try:
                    stub.Generate(generate("late", 1), timeout=10)
                except grpc.RpcError as failure:
                    assert failure.code() == grpc.StatusCode.UNAVAILABLE, failure
                    break
                assert time.monotonic() < refused_at, "new calls were still admitted 5 s after SIGTERM"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as late_stream:
                list(stub.Stream(stream("late", 1), timeout=10))
            assert late_stream.value.code() == grpc.StatusCode.UNAVAILABLE
            status = health.Check(health_pb2.HealthCheckRequest(service="ladle.v1.EngineService"), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).accepting

            for reader in readers:
                reader.join(120)
        assert not errors, errors
        assert len(results) == NUM_STREAMS
        for responses in results.values():
            _, ids, finish = joined_stream(responses)[0]
            assert len(ids) == MAX_TOKENS and finish == types_pb2.FINISH_REASON_LENGTH
        assert engine.process.wait(60) == 0
    finally:
        engine.stop(10)
