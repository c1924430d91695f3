"""Per-project rate limits against the real engine, through two gateway replicas sharing PostgreSQL: a project at
its requests-per-minute limit gets 429 with OpenAI's error, `retry-after` and the `x-ratelimit-*` headers while
another project's requests pass; the limit is one across both replicas; the token count is corrected to what the
requests actually used; a project past its batch budget cannot create a batch."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, start_gateway

pytestmark = pytest.mark.slow

KEYS = "sk-alpha alpha\nsk-beta beta\nsk-gamma gamma\nsk-delta delta\n"
LIMITS = ("alpha requests_per_minute=4\n"
          "gamma tokens_per_minute=4000\n"
          "delta batch_tokens_per_day=1\n")
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def replicas(engine: EngineProcess, postgres: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[list[GatewayProcess]]:
    root = tmp_path_factory.mktemp("rate-limits")
    (root / "keys").write_text(KEYS)
    (root / "limits").write_text(LIMITS)
    flags = ["--database-url", postgres.new_database(), "--data-dir", str(root / "shared"), "--api-keys-file",
             str(root / "keys"), "--rate-limits-file", str(root / "limits")]
    with ThreadPoolExecutor(2) as pool:
        gateways = list(pool.map(lambda i: start_gateway(root / f"replica-{i}.log", engine.address, *flags),
                                 range(2)))
    yield gateways
    for gateway in gateways:
        assert gateway.stop() == 0


def chat(gateway: GatewayProcess, key: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": MAX_TOKENS, **extra}
    return httpx.post(gateway.base_url + "/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def fresh_minute(needed_s: float = 25) -> None:
    """Wait, if need be, until the current minute has `needed_s` seconds left, so a test's requests share one."""
    left = 60 - time.time() % 60
    if left < needed_s:
        time.sleep(left + 0.5)


def test_a_project_at_its_limit_gets_429_across_replicas_and_others_pass(
    replicas: list[GatewayProcess], model_id: str
) -> None:
    fresh_minute()
    answers = [chat(replicas[i % 2], "sk-alpha", model_id) for i in range(4)]  # two through each replica
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["3", "2", "1", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "4" for a in answers)
    for gateway in replicas:
        refused = chat(gateway, "sk-alpha", model_id)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and "RPM" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    other = chat(replicas[0], "sk-beta", model_id)
    assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers


def test_the_token_count_is_what_the_requests_used(replicas: list[GatewayProcess], model_id: str) -> None:
    fresh_minute()
    first = chat(replicas[0], "sk-gamma", model_id)
    assert first.status_code == 200
    reserved_left = int(first.headers["x-ratelimit-remaining-tokens"])  # admitted on an estimate + max_tokens
    used = first.json()["usage"]["total_tokens"]
    assert reserved_left != 4000 - used
    time.sleep(0.5)  # the correction runs after the answer
    second = chat(replicas[1], "sk-gamma", model_id)
    assert second.status_code == 200
    reserve = 4000 - reserved_left  # the same body reserves the same estimate
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 4000 - used - reserve
    too_large = chat(replicas[0], "sk-gamma", model_id, max_tokens=5000)
    assert too_large.status_code == 429 and "Request too large" in too_large.json()["error"]["message"]


def test_a_project_past_its_batch_budget_cannot_create_a_batch(
    replicas: list[GatewayProcess], model_id: str, tmp_path: Path
) -> None:
    headers = {"Authorization": "Bearer sk-delta"}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}
    base = replicas[0].base_url

    def create() -> httpx.Response:
        upload = httpx.post(base + "/files", headers=headers, data={"purpose": "batch"}, timeout=60,
                            files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")}).json()
        return httpx.post(base + "/batches", headers=headers, timeout=60, json={
            "input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})

    batch = create().json()
    deadline = time.monotonic() + 120
    while (batch := httpx.get(f"{base}/batches/{batch['id']}", headers=headers).json())["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(2)  # its usage flushed
    refused = create()
    assert refused.status_code == 429 and "batch tokens" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) > 0
