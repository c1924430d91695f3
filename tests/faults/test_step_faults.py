"""A model forward that fails (injected through LADLE_INJECT_FAULT, see engine_server/faults.py): the requests in
that step end with INTERNAL, health turns NOT_SERVING, then the engine either serves again (one failed step)
or, when the fault stays, drains and exits with status 1. Never a hang, never a silent wrong answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.v1 import engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.helpers import generate, stream

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthWatch:
    """Every status the engine's health Watch reports, in order, from a background thread."""

    def __init__(self, address: str) -> None:
        self.statuses: list[int] = []
        self._channel = grpc.insecure_channel(address)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(health_pb2.HealthCheckRequest(service=""))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.statuses.append(response.status)
        except grpc.RpcError:
            pass  # cancelled by close(), or the engine went away

    def wait_for(self, sequence: list[int], timeout: float) -> None:
        """Wait until `sequence` appears, in order (not necessarily adjacent), among the reported statuses."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = iter(self.statuses)
            if all(any(status == wanted for status in seen) for wanted in sequence):
                return
            time.sleep(0.05)
        raise AssertionError(f"health reported {self.statuses}, never {sequence}")

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


@pytest.fixture
def fault_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The trigger file; engines started in the test watch it (absent: no fault)."""
    path = tmp_path / "fault"
    monkeypatch.setenv("LADLE_INJECT_FAULT", str(path))
    return path


@pytest.fixture
def engine(fault_file: Path, tmp_path: Path) -> Iterator[EngineProcess]:
    process = start_engine(tmp_path / "engine.log", "--max-num-seqs", "8")
    yield process
    process.stop(30)


def arm(fault_file: Path, mode: str) -> None:
    """Create the trigger with its content in one step (a rename): a forward that found it created but still
    empty would take it for a fault that stays, fail the recovery probe too, and the engine would exit."""
    staged = fault_file.with_name(fault_file.name + ".staged")
    staged.write_text(mode)
    staged.replace(fault_file)


def start_streams(stub: engine_pb2_grpc.EngineServiceStub, count: int) -> list[Iterator[object]]:
    """`count` long streams, each one past its first response (all running)."""
    calls = []
    for i in range(count):
        call = iter(stub.Stream(stream(f"Tell a long story, number {i}.", 2000, ignore_eos=True), timeout=120))
        next(call)
        calls.append(call)
    return calls


def assert_failed_internal(call: Iterator[object]) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        for _ in call:
            pass
    assert failure.value.code() == grpc.StatusCode.INTERNAL
    assert "failed a step" in (failure.value.details() or "")


def test_one_failed_step_fails_its_requests_and_the_engine_serves_again(
    engine: EngineProcess, fault_file: Path
) -> None:
    health = HealthWatch(engine.address)
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            calls = start_streams(stub, 4)
            arm(fault_file, "once")
            for call in calls:
                assert_failed_internal(call)
            health.wait_for([SERVING, NOT_SERVING, SERVING], timeout=60)
            assert not fault_file.exists()  # consumed by the one forward that failed
            reply = stub.Generate(generate("Still serving?", 4), timeout=60)
            assert reply.choices[0].token_ids
        assert engine.process.poll() is None
        assert "engine recovered after a failed step" in engine.log()
    finally:
        health.close()
    assert engine.stop(30) == 0


def test_a_fault_that_stays_makes_the_engine_exit_1(engine: EngineProcess, fault_file: Path) -> None:
    health = HealthWatch(engine.address)
    try:
        with grpc.insecure_channel(engine.address) as channel:
            calls = start_streams(engine_pb2_grpc.EngineServiceStub(channel), 2)
            arm(fault_file, "always")
            for call in calls:
                assert_failed_internal(call)
        health.wait_for([SERVING, NOT_SERVING], timeout=30)
        assert engine.process.wait(60) == 1
    finally:
        health.close()
    assert "the engine cannot serve; stopping with exit status 1" in engine.log()
    assert "probe generation after a failed step failed" in engine.log()
