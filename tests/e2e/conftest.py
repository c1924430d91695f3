"""Real `ladle engine` processes on loopback, on the embedded model (fp32, CPU), for the end-to-end tests.

`engine` is one engine for the whole session; tests that need their own configuration or kill their engine
start one with `start_engine`. Every engine logs JSON lines to a file the tests can read (`EngineProcess.log`).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from ladle.v1 import engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """The shared engine: up to 32 sequences at once.

    Its grammars get 120 s to compile instead of 10: on a 2-core box the niced compile workers starve while the
    suite's concurrent constrained requests decode (more so since the embedded model's own defaults, temperature
    0.2 and top_p 0.9, lengthen them), and the deadline itself is tested on an engine of its own
    (test_slow_grammar.py)."""
    process = start_engine(
        tmp_path_factory.mktemp("engine") / "engine.log", "--max-num-seqs", "32", "--grammar-timeout", "120"
    )
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


@pytest.fixture(scope="session")
def gateway(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A `ladle gateway` process in front of the shared engine, without an API key."""
    process = start_gateway(tmp_path_factory.mktemp("gateway") / "gateway.log", engine.address)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="session")
def openai_client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    """The official OpenAI SDK pointed at the gateway."""
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="session")
def model_id(openai_client: openai.OpenAI) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="session")
def gateway_http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    """Plain HTTP to the gateway, for what the SDK hides (raw SSE, headers, error bodies, extra routes)."""
    with httpx.Client(base_url=gateway.url, timeout=300) as client:
        yield client
