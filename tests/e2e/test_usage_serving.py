"""Usage per project and the admin role, against the real engine: after a mixed run (chat whole and streamed,
completions, a Responses call, a batch job) the usage endpoint and the /metrics counters equal the sums of the
responses' own `usage` per project and kind, also after the gateway restarts; a project's key sees its own usage
only and gets 403 on /metrics once an admin key exists, which passes."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, start_gateway

pytestmark = pytest.mark.slow

KEYS = "sk-alpha alpha\nsk-beta beta\nsk-ops ops admin\n"
USAGE = "/v1/organization/usage/completions"
Totals = Counter[tuple[str, str, str]]  # (project, kind, field) -> tokens or requests


def start(tmp_path: Path, engine: EngineProcess, name: str) -> GatewayProcess:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    return start_gateway(tmp_path / f"{name}.log", engine.address, "--api-keys-file", str(keys), "--data-dir",
                         str(tmp_path / "data"))


def sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=120)


def add(totals: Totals, project: str, kind: str, input_tokens: int, output_tokens: int, requests: int = 1) -> None:
    totals[(project, kind, "input")] += input_tokens
    totals[(project, kind, "output")] += output_tokens
    totals[(project, kind, "requests")] += requests


def mixed_run(gateway: GatewayProcess, model: str, tmp_path: Path) -> Totals:
    """Requests of two projects; the sums of what their responses say they used."""
    totals: Totals = Counter()
    alpha, beta = sdk(gateway, "sk-alpha"), sdk(gateway, "sk-beta")
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    chat = alpha.chat.completions.create(model=model, messages=messages, max_tokens=6)
    assert chat.usage is not None
    add(totals, "alpha", "interactive", chat.usage.prompt_tokens, chat.usage.completion_tokens)
    chunks = list(alpha.chat.completions.create(model=model, messages=messages, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed is not None
    add(totals, "alpha", "interactive", streamed.prompt_tokens, streamed.completion_tokens)
    text = alpha.completions.create(model=model, prompt=["One", "Two"], max_tokens=3)
    assert text.usage is not None
    add(totals, "alpha", "interactive", text.usage.prompt_tokens, text.usage.completion_tokens)
    response = alpha.responses.create(model=model, input="Hi", max_output_tokens=4)
    assert response.usage is not None
    add(totals, "alpha", "interactive", response.usage.input_tokens, response.usage.output_tokens)
    other = beta.chat.completions.create(model=model, messages=messages, max_tokens=7)
    assert other.usage is not None
    add(totals, "beta", "interactive", other.usage.prompt_tokens, other.usage.completion_tokens)

    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": model, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": f"Say {i}."}]}}) + "\n"
                            for i in range(3)))
    with path.open("rb") as f:
        upload = beta.files.create(file=f, purpose="batch")
    batch = beta.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := beta.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status not in ("failed", "cancelled"), batch.status
        time.sleep(0.2)
    results = [json.loads(line) for line in beta.files.content(batch.output_file_id or "").text.splitlines()]
    for result in results:
        used = result["response"]["body"]["usage"]
        add(totals, "beta", "batch", used["prompt_tokens"], used["completion_tokens"])
    return totals


def endpoint_totals(gateway: GatewayProcess, key: str, **params: Any) -> Totals:
    reply = httpx.get(gateway.base_url + USAGE.removeprefix("/v1"), headers={"Authorization": f"Bearer {key}"},
                      params={"start_time": int(time.time()) - 86_400, **params}, timeout=30)
    assert reply.status_code == 200, reply.text
    totals: Totals = Counter()
    for bucket in reply.json()["data"]:
        for r in bucket["results"]:
            kind = "batch" if r["batch"] else "interactive"
            add(totals, r["project_id"] or "", kind, r["input_tokens"], r["output_tokens"], r["num_model_requests"])
    return totals


def metric_totals(gateway: GatewayProcess) -> Totals:
    reply = httpx.get(gateway.url + "/metrics", headers={"Authorization": "Bearer sk-ops"}, timeout=30)
    assert reply.status_code == 200
    totals: Totals = Counter()
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "ladle_gateway_usage_tokens_total" and labels["type"] in ("input", "output"):
                totals[(labels["project"], labels["kind"], labels["type"])] += int(sample.value)
            elif sample.name == "ladle_gateway_usage_requests_total":
                totals[(labels["project"], labels["kind"], "requests")] += int(sample.value)
    return +totals


def test_usage_per_project_and_kind_equals_the_responses_and_survives_a_restart(
    engine: EngineProcess, model_id: str, tmp_path: Path
) -> None:
    gateway = start(tmp_path, engine, "first")
    try:
        expected = mixed_run(gateway, model_id, tmp_path)
        time.sleep(2)  # a flush a second
        grouped = {"group_by": ["project_id", "batch"]}
        assert endpoint_totals(gateway, "sk-ops", **grouped) == expected
        assert metric_totals(gateway) == expected
        alpha_only = endpoint_totals(gateway, "sk-alpha")  # its own project, not grouped: project_id null
        assert {(k[1], k[2]): v for k, v in alpha_only.items()} == {
            (k[1], k[2]): v for k, v in expected.items() if k[0] == "alpha"}
        refused = httpx.get(gateway.base_url + USAGE.removeprefix("/v1"), timeout=30,
                            headers={"Authorization": "Bearer sk-alpha"},
                            params={"start_time": 0, "project_ids": ["beta"]})
        assert refused.status_code == 403 and refused.json()["error"]["param"] == "project_ids"
        for key, status in (("sk-alpha", 403), ("sk-ops", 200), ("sk-nope", 401)):
            assert httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code == status
    finally:
        assert gateway.stop() == 0
    restarted = start(tmp_path, engine, "second")
    try:
        assert endpoint_totals(restarted, "sk-ops", group_by=["project_id", "batch"]) == expected
    finally:
        assert restarted.stop() == 0


def test_a_stream_its_client_leaves_is_counted_with_what_the_engine_had_sent(
    engine: EngineProcess, model_id: str, tmp_path: Path
) -> None:
    """A client that reads three content chunks of a long stream and hangs up: its project is counted one request,
    the prompt's tokens and what was generated before the engine aborted (at least the three chunks' tokens, far
    fewer than max_tokens), not nothing."""
    gateway = start(tmp_path, engine, "left")
    messages: Any = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    try:
        whole = sdk(gateway, "sk-beta").chat.completions.create(model=model_id, messages=messages, max_tokens=1)
        assert whole.usage is not None
        body = {"model": model_id, "messages": messages, "max_tokens": 400, "stream": True, "ignore_eos": True}
        content_chunks = 0
        with httpx.stream("POST", gateway.base_url + "/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sk-alpha"}) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    content_chunks += 1
                    if content_chunks == 3:
                        break  # leaving the block closes the connection
        deadline = time.monotonic() + 30
        while (totals := endpoint_totals(gateway, "sk-alpha"))[("", "interactive", "requests")] == 0:
            assert time.monotonic() < deadline, "the stream left early was never counted"
            time.sleep(0.2)
        assert totals[("", "interactive", "requests")] == 1
        assert totals[("", "interactive", "input")] == whole.usage.prompt_tokens
        assert 3 <= totals[("", "interactive", "output")] < 400
    finally:
        assert gateway.stop() == 0
