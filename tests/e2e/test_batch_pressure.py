"""Batch jobs against a real engine under pressure (`--max-num-seqs 2 --max-waiting 2`): no healthy line fails, a
poison line ends as its own error line, and one project's poison batch does not hold another project's batch.

Before attempts were retried under fresh item ids (and the engine held a Batch call's items while its queue was
full), a 60-line chat batch here ended with 400s ("item_id '3:0' was already used in this call") and a 12-line
embeddings batch with 40 inputs a line ended 0/12; a reply over the gateway's message limit ran again forever.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT, EMBEDDINGS = "/v1/chat/completions", "/v1/embeddings"
KEYS = {"sk-project-a": "a", "sk-project-b": "b"}


@pytest.fixture(scope="module")
def pressed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engine = start_engine(tmp_path_factory.mktemp("pressed") / "engine.log", "--max-num-seqs", "2",
                          "--max-waiting", "2")
    yield engine
    assert engine.stop() == 0


@pytest.fixture(scope="module")
def gateway(pressed_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Two projects' keys, and replies capped at 0.1 MiB (so a line asking for n=8 with 20 log-probabilities per
    token goes over it)."""
    folder = tmp_path_factory.mktemp("pressure-gateway")
    keys = folder / "keys"
    keys.write_text("".join(f"{key} {project}\n" for key, project in KEYS.items()))
    process = start_gateway(folder / "gateway.log", pressed_engine.address, "--api-keys-file", str(keys),
                            "--max-engine-message-mib", "0.1")
    yield process
    assert process.stop() == 0


def sdk(gateway: GatewayProcess, project: str) -> openai.OpenAI:
    key = next(k for k, p in KEYS.items() if p == project)
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=120)


def chat_line(i: int, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"c{i}", "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i % 7 + 2}."}],
                     "max_tokens": 8, "temperature": 0, **body}}


def embed_line(i: int) -> dict[str, Any]:
    return {"custom_id": f"e{i}", "method": "POST", "url": EMBEDDINGS,
            "body": {"model": MODEL, "input": [f"sentence {i} number {j}" for j in range(40)]}}


POISON = {"n": 8, "max_tokens": 32, "logprobs": True, "top_logprobs": 20, "ignore_eos": True, "temperature": 1.0}


def write(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def run_batch(client: openai.OpenAI, path: Path, endpoint: str) -> str:
    with path.open("rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h").id  # type: ignore[arg-type]


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in {"completed", "failed", "cancelled", "expired"}:
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.2)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def test_the_engine_holds_a_batch_calls_items_instead_of_refusing_them(pressed_engine: EngineProcess) -> None:
    """Twenty items at once on a queue of 2: every one runs (none RESOURCE_EXHAUSTED), and a reused item id is
    still refused INVALID_ARGUMENT, the rule the gateway's retries keep to."""
    request = engine_pb2.GenerateRequest()
    request.input.text = "Say hi."
    request.sampling.max_tokens = 4
    items = [engine_pb2.BatchRequest(item_id=str(i), request=request) for i in range(20)]
    items.append(engine_pb2.BatchRequest(item_id="3", request=request))
    with grpc.insecure_channel(pressed_engine.address) as channel:
        replies = list(engine_pb2_grpc.EngineServiceStub(channel).Batch(iter(items), timeout=300))
    outcomes = Counter(r.WhichOneof("outcome") for r in replies)
    assert outcomes == Counter({"result": 20, "error": 1}), outcomes
    [refused] = [r for r in replies if r.WhichOneof("outcome") == "error"]
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already used" in refused.error.message


def test_chat_and_wide_embeddings_batches_complete_with_no_failed_line(gateway: GatewayProcess,
                                                                        tmp_path: Path) -> None:
    client = sdk(gateway, "a")
    chat = run_batch(client, write(tmp_path / "chat.jsonl", [chat_line(i) for i in range(60)]), CHAT)
    embeddings = run_batch(client, write(tmp_path / "embed.jsonl", [embed_line(i) for i in range(12)]), EMBEDDINGS)
    for batch_id, total in ((chat, 60), (embeddings, 12)):
        batch = wait_final(client, batch_id)
        errors = lines_of(client, batch.error_file_id)
        assert batch.status == "completed" and batch.request_counts is not None, batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (total, 0), errors[:2]
    vectors = lines_of(client, client.batches.retrieve(embeddings).output_file_id)
    assert all(len(line["response"]["body"]["data"]) == 40 for line in vectors)


def test_the_same_files_through_ladle_batch(pressed_engine: EngineProcess, tmp_path: Path) -> None:
    for name, items in (("chat", [chat_line(i) for i in range(60)]), ("embed", [embed_line(i) for i in range(12)])):
        output = tmp_path / f"{name}.out.jsonl"
        done = subprocess.run([sys.executable, "-m", "ladle_cli", "batch", "-i", str(write(tmp_path / name, items)),
                               "-o", str(output), "--engine", pressed_engine.address],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        results = [json.loads(line) for line in output.read_text().splitlines()]
        statuses = Counter(r["response"]["status_code"] for r in results)
        assert statuses == Counter({200: len(items)}), [r for r in results if r["response"]["status_code"] != 200][:2]


def test_a_poison_line_fails_alone_while_another_projects_batch_completes(gateway: GatewayProcess,
                                                                           tmp_path: Path) -> None:
    """Project A's batch holds a line whose reply is over the gateway's message limit: that line alone ends as an
    error line (after bounded attempts, never forever) and the rest of A's batch completes; project B's one-line
    batch, submitted after A's, completes first."""
    a, b = sdk(gateway, "a"), sdk(gateway, "b")
    items = [chat_line(i) for i in range(30)]
    items[3] = chat_line(3, **POISON)
    batch_a = run_batch(a, write(tmp_path / "a.jsonl", items), CHAT)
    time.sleep(0.5)
    batch_b = run_batch(b, write(tmp_path / "b.jsonl", [chat_line(100)]), CHAT)
    done_b = wait_final(b, batch_b)
    assert done_b.status == "completed" and done_b.request_counts.completed == 1  # type: ignore[union-attr]
    done_a = wait_final(a, batch_a)
    assert done_a.status == "completed" and done_a.completed_at >= done_b.completed_at  # type: ignore[operator]
    assert (done_a.request_counts.completed, done_a.request_counts.failed) == (29, 1)  # type: ignore[union-attr]
    [error] = lines_of(a, done_a.error_file_id)
    assert error["custom_id"] == "c3" and error["response"]["status_code"] == 500
    body = error["response"]["body"]["error"]
    assert body["code"] == "reply_too_large" and "message limit" in body["message"]
