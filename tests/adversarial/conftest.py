"""One real `ladle engine` (constraints limited to 1 s of compiling) and one `ladle gateway` in front of it, shared
by the adversarial cases of this package and by no other: a case that hurts them cannot hide behind other tests,
and theirs cannot leak in. Cases that need other flags start their own processes with the same helpers."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway

GRAMMAR_TIMEOUT_S = 1.0


@pytest.fixture(scope="package")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = start_engine(tmp_path_factory.mktemp("adversarial-engine") / "engine.log", "--max-num-seqs", "32",
                           "--grammar-timeout", str(GRAMMAR_TIMEOUT_S))
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="package")
def stub(engine: EngineProcess) -> Iterator[engine_pb2_grpc.EngineServiceStub]:
    """The generated stub on a plain channel that may send messages of any size (the engine's limit is tested)."""
    with grpc.insecure_channel(engine.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


@pytest.fixture(scope="package")
def vocab_size(stub: engine_pb2_grpc.EngineServiceStub) -> int:
    size: int = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10).vocab_size
    return size


@pytest.fixture(scope="package")
def gateway(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(tmp_path_factory.mktemp("adversarial-gateway") / "gateway.log", engine.address)
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="package")
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="package")
def model_id(http: httpx.Client) -> str:
    model: str = http.get("/v1/models").json()["data"][0]["id"]
    return model
