"""Real `ladle engine` processes on loopback, on the embedded model (fp32, CPU), for the end-to-end tests.

`engine` is one engine for the whole session; tests that need their own configuration or kill their engine
start one with `start_engine`. Every engine logs JSON lines to a file the tests can read (`EngineProcess.log`).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from ladle.v1 import engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """The shared engine: up to 32 sequences at once."""
    process = start_engine(tmp_path_factory.mktemp("engine") / "engine.log", "--max-num-seqs", "32")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="session")
def channel(engine: EngineProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> engine_pb2_grpc.EngineServiceStub:
    """The generated stub on a plain channel (no retries): what another service would write."""
    return engine_pb2_grpc.EngineServiceStub(channel)
