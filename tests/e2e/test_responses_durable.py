"""Stored responses outlive their gateway: `previous_response_id` continues a conversation through a second replica
sharing PostgreSQL, also after the first is killed with -9; another project's key sees none of them (404); a
background response whose gateway is killed mid-generation completes after a restart; and a batch job of 1,000
/v1/responses lines (and `ladle batch` on the same file) ends with every custom_id exactly once. All against the
real engine on the embedded model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import start_gateway

pytestmark = pytest.mark.slow

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
LEASE = ("--batch-lease", "3", "--health-interval", "0.25")
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400,
          "maxItems": 400}  # ~800 tokens: long enough to be killed in the middle
LINES = 1000


def client(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


def assert_not_found(call: Callable[[], object]) -> None:
    with pytest.raises(openai.NotFoundError):
        call()


def test_replicas_share_stored_responses_and_projects_stay_apart(
    engine: EngineProcess, model_id: str, postgres: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{key} {project}\n" for key, project in KEYS.items()))
    flags = ["--database-url", postgres.new_database(), "--data-dir", str(tmp_path / "shared"), "--api-keys-file",
             str(keys), *LEASE]
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda i: start_gateway(tmp_path / f"replica-{i}.log", engine.address, *flags),
                                 range(2)))
    first, second = (client(g.base_url, "sk-alpha") for g in replicas)
    beta = client(replicas[1].base_url, "sk-beta")
    try:
        opening = first.responses.create(model=model_id, input="My name is Ada. Say hello.", max_output_tokens=12,
                                         temperature=0)
        follow = second.responses.create(model=model_id, input="What is my name?", max_output_tokens=12,
                                         temperature=0, previous_response_id=opening.id)
        assert follow.usage is not None and opening.usage is not None
        assert follow.usage.input_tokens > opening.usage.input_tokens + opening.usage.output_tokens

        for call in (lambda: beta.responses.retrieve(opening.id), lambda: beta.responses.delete(opening.id),
                     lambda: beta.responses.input_items.list(opening.id), lambda: beta.responses.cancel(opening.id),
                     lambda: beta.responses.create(model=model_id, input="x", previous_response_id=opening.id)):
            assert_not_found(call)

        os.kill(replicas[0].process.pid, signal.SIGKILL)
        replicas[0].process.wait()
        third = second.responses.create(model=model_id, input="And again?", max_output_tokens=8, temperature=0,
                                        previous_response_id=follow.id)
        assert third.usage is not None and third.usage.input_tokens > follow.usage.input_tokens
        assert second.responses.retrieve(opening.id).output_text == opening.output_text
    finally:
        for gateway in replicas:
            if gateway.process.poll() is None:
                assert gateway.stop() == 0


def test_a_background_response_completes_after_its_gateway_is_killed(
    engine: EngineProcess, model_id: str, tmp_path: Path
) -> None:
    flags = ["--data-dir", str(tmp_path / "data"), *LEASE]
    killed = start_gateway(tmp_path / "killed.log", engine.address, *flags)
    response = client(killed.base_url).responses.create(
        model=model_id, input="List digits.", background=True, max_output_tokens=2000,
        text={"format": {"type": "json_schema", "name": "digits", "schema": DIGITS}})
    deadline = time.monotonic() + 60
    while client(killed.base_url).responses.retrieve(response.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1)  # well into the generation
    assert client(killed.base_url).responses.retrieve(response.id).status == "in_progress"
    os.kill(killed.process.pid, signal.SIGKILL)
    killed.process.wait()
    restarted = start_gateway(tmp_path / "restarted.log", engine.address, *flags)
    try:
        sdk = client(restarted.base_url)
        deadline = time.monotonic() + 300
        while (done := sdk.responses.retrieve(response.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, done.status
            time.sleep(0.25)
        assert done.status == "completed", done
        assert '"attempt": 2' in restarted.log()  # claimed again once the killed gateway's lease ran out
        jsonschema.validate(json.loads(done.output_text), DIGITS)
    finally:
        assert restarted.stop() == 0


def test_a_thousand_responses_lines_each_once(engine: EngineProcess, model_id: str, gateway: Any,
                                              tmp_path: Path) -> None:
    """Through the gateway's batch job and through `ladle batch`."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
        "body": {"model": model_id, "input": f"Number {i}", "instructions": "Answer with one word.",
                 "max_output_tokens": 1}}) + "\n" for i in range(LINES)))
    sdk = client(gateway.base_url)
    with source.open("rb") as f:
        upload = sdk.files.create(file=f, purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")

    output = tmp_path / "out.jsonl"
    offline = subprocess.run([sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output),
                              "--engine", engine.address], capture_output=True, text=True, timeout=900)
    assert offline.returncode == 0, offline.stderr
    offline_lines = [json.loads(line) for line in output.read_text().splitlines()]

    deadline = time.monotonic() + 900
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(1)
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    online_lines = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    for results in (online_lines, offline_lines):
        assert Counter(r["custom_id"] for r in results) == Counter(f"r{i}" for i in range(LINES))
        assert {r["response"]["status_code"] for r in results} == {200}
        assert {r["response"]["body"]["status"] for r in results} <= {"completed", "incomplete"}


def test_stored_responses_past_their_retention_are_deleted(engine: EngineProcess, model_id: str,
                                                           tmp_path: Path) -> None:
    """With `--response-retention-days` (here 5 s) a stored response can be read at first, and is gone (404) once
    it is older than that. (That younger ones are kept: tests/unit/test_responses_store.py.)"""
    gateway = start_gateway(tmp_path / "gateway.log", engine.address, "--response-retention-days", str(5 / 86_400),
                            "--file-sweep-interval", "0.2")
    sdk = client(gateway.base_url)
    try:
        first = sdk.responses.create(model=model_id, input="Say hi.", max_output_tokens=4)
        assert sdk.responses.retrieve(first.id).id == first.id
        deadline = time.monotonic() + 30
        while True:
            try:
                sdk.responses.retrieve(first.id)
            except openai.NotFoundError:
                break
            assert time.monotonic() < deadline, "the response outlived its retention"
            time.sleep(0.2)
    finally:
        assert gateway.stop() == 0
