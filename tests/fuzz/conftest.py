"""One real `ladle engine` and `ladle gateway` for the fuzz tests, shared by this package and by no other, so a
fault the fuzzing provokes cannot leak into other tests (and theirs cannot hide one here)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway


def pytest_itemcollected(item: Any) -> None:
    """Give each operation's schemathesis test its own node id (`test_...[POST /v1/completions]`).

    schemathesis (4.32) names its items after the operation but passes no parameters to pytest 9, which builds a
    node id from the function's name and parameters only: every operation's test then had the same id, and
    pytest-xdist's file scheduling, which keys tests by id, ran only the first operation's (10 cases, not ~1,800)."""
    label = getattr(item, "operation_label", None)
    if label is not None and item._id.params is None:
        item._id = item._id.with_params(label)


@pytest.fixture(scope="package")
def fuzz_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = start_engine(tmp_path_factory.mktemp("fuzz-engine") / "engine.log", "--max-num-seqs", "16")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="package")
def fuzz_gateway(fuzz_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(tmp_path_factory.mktemp("fuzz-gateway") / "gateway.log", fuzz_engine.address)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="package")
def model_id(fuzz_gateway: GatewayProcess) -> str:
    model: str = httpx.get(fuzz_gateway.base_url + "/models", timeout=30).json()["data"][0]["id"]
    return model
