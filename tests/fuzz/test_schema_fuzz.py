"""Schema fuzzing, short profile (CI): schemathesis draws positive and negative cases from the gateway's OpenAPI
document and sends them to a real `ladle gateway` in front of a real `ladle engine` on loopback.

Every response must be below 500, conform to the document (status, content type, schema of error bodies) and,
when it is an error, carry OpenAI's error shape; negative cases must be refused; the engine must still serve
afterwards. Positive generation and pooling bodies are made cheap first (benchmarks.fuzz_cases.cheapen_case: <= 4
tokens, n <= 2, <= 4 inputs or documents of short texts); negative ones go out as drawn. The long profile is
`ladle bench fuzz` (benchmarks/fuzz_gateway.py).

The fuzzed document is built at import from `create_app(...).openapi()`, since schemathesis parametrizes at
collection time (its lazy `schemathesis.pytest.from_fixture` reads `Function._nodeid`, which pytest 9 removed);
`test_the_gateway_serves_the_fuzzed_document` checks that the running gateway serves exactly this document.
The engine and gateway are this package's own (tests/fuzz/conftest.py).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis

from benchmarks.fuzz_cases import REQUEST_TIMEOUT_S, FuzzTally, cheapen_case, configure_schema
from gateway.app import create_app
from gateway.config import GatewayConfig
from ladle.client import EngineClient
from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 15  # per operation in the fuzzing phase; the coverage phase adds its own boundary cases
PHASES = ("examples", "coverage", "fuzzing")
DOCUMENT = create_app(GatewayConfig(engines=("127.0.0.1:1",))).openapi()
SCHEMA = configure_schema(schemathesis.openapi.from_dict(DOCUMENT), max_examples=MAX_EXAMPLES, seed=0,
                          phases=PHASES)


@pytest.fixture(scope="module")
def tally() -> FuzzTally:
    """Every case sent by this module and what answered it (per operation), for the summary test."""
    return FuzzTally()


def test_the_gateway_serves_the_fuzzed_document(fuzz_gateway: GatewayProcess) -> None:
    assert httpx.get(fuzz_gateway.url + "/openapi.json", timeout=30).json() == DOCUMENT


@SCHEMA.parametrize()
def test_the_gateway_answers_fuzzed_requests(
    case: Any, fuzz_gateway: GatewayProcess, model_id: str, tally: FuzzTally
) -> None:
    cheapen_case(case, model_id)
    response = case.call(base_url=fuzz_gateway.url, timeout=REQUEST_TIMEOUT_S)
    problem = tally.record(case, response)
    case.validate_response(response)
    assert problem is None, f"{case.method} {case.path} answered {response.status_code}: {problem}"


def test_the_engine_survived_the_fuzzing(
    fuzz_engine: EngineProcess, fuzz_gateway: GatewayProcess, model_id: str, tally: FuzzTally,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if not tally.examples:
        pytest.skip("the fuzzing test did not run in this session")
    assert fuzz_engine.process.poll() is None, fuzz_engine.log()[-4000:]
    with EngineClient(fuzz_engine.address) as client:
        client.wait_until_serving(10.0)
    body = {"model": model_id, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    response = httpx.post(fuzz_gateway.base_url + "/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200 and response.json()["choices"]
    assert tally.server_errors == 0 and tally.shape_problems == 0, tally.failures
    reached_engine = sum(t.statuses.get("200", 0) for path, t in tally.operations.items() if "completions" in path)
    assert tally.examples > 1000 and reached_engine > 0, {k: v.as_json() for k, v in tally.operations.items()}
    with capsys.disabled():
        print(f"\nschema fuzzing: {tally.examples} cases on {len(tally.operations)} method/path pairs in "
              f"{time.monotonic() - tally.started:.0f} s, {reached_engine} generated; no 5xx, the engine serves")
