"""OpenAI's files and batches workflow with the official SDK against real gateway and engine processes, on
SQLite and on a real PostgreSQL: uploads, batches that match the synchronous routes, every refusal, cancel,
and `kill -9` of the gateway or the engine in the middle of a batch."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FINAL = {"completed", "failed", "cancelled", "expired"}
TOPICS = ["the sea", "a cat", "rain", "Paris", "music", "a robot", "the moon", "bread", "trains", "snow"]


Backend = Callable[[], list[str]]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Gateway flags for a new store on the database under test: SQLite in the gateway's data directory, or a
    new database on the test PostgreSQL server (a store's database goes with its one blob directory)."""
    if request.param == "sqlite":
        return list
    server = request.getfixturevalue("postgres")
    return lambda: ["--database-url", server.new_database()]


@pytest.fixture(scope="module")
def batch_gateway(engine: EngineProcess, backend: Backend, tmp_path_factory: pytest.TempPathFactory,
                  ) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path_factory.mktemp("batches") / "gateway.log", engine.address, *backend())
    yield gateway
    assert gateway.stop() == 0


@pytest.fixture(scope="module")
def client(batch_gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=batch_gateway.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat_body(model: str, i: int, max_tokens: int = 12) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    return {"model": model, "messages": [{"role": "user", "content": f"Write one sentence about {topic} ({i})."}],
            "max_tokens": max_tokens, "temperature": 0}


def line(custom_id: str, body: dict[str, Any], url: str = CHAT, method: str = "POST") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def upload(client: openai.OpenAI, tmp: Path, items: Iterable[Any], purpose: str = "batch") -> str:
    path = tmp / f"in-{time.monotonic_ns()}.jsonl"
    path.write_bytes(b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items))
    with path.open("rb") as f:
        return client.files.create(file=f, purpose=purpose).id  # type: ignore[arg-type]


def pauses(longest: float) -> Iterator[float]:
    """The pauses between two polls of a condition: short at first (most hold within a fraction of a second),
    then growing to `longest` (a long wait asks the gateway little)."""
    pause = 0.02
    while True:
        yield pause
        pause = min(longest, pause * 1.5)


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 240) -> Any:
    deadline, wait = time.monotonic() + timeout, pauses(0.2)
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
        except (openai.APIConnectionError, openai.InternalServerError):
            pass  # a gateway being restarted
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} not in {statuses} after {timeout} s")
        time.sleep(next(wait))


def wait_for_completed(client: openai.OpenAI, batch_id: str, lines: int, timeout: float = 240) -> None:
    """Wait until at least `lines` of the batch have committed results (the batch is then well under way)."""
    deadline, wait = time.monotonic() + timeout, pauses(0.1)
    while (done := client.batches.retrieve(batch_id).request_counts.completed) < lines:
        assert time.monotonic() < deadline, f"batch {batch_id}: {done} lines completed after {timeout} s"
        time.sleep(next(wait))


def wait_for_log(process: GatewayProcess, text: str, timeout: float = 60) -> None:
    deadline, wait = time.monotonic() + timeout, pauses(0.1)
    while text not in process.log():
        assert time.monotonic() < deadline, f"{text!r} not in {process.log_path} after {timeout} s"
        time.sleep(next(wait))


def start_engine_and_gateway(tmp: Path, engine_flags: tuple[str, ...], *gateway_flags: str
                             ) -> tuple[EngineProcess, GatewayProcess]:
    """An engine on the port `engine_flags` name and a gateway in front of it, started side by side (the
    gateway is healthy once the engine serves)."""
    port = engine_flags[engine_flags.index("--port") + 1]
    with ThreadPoolExecutor(2) as pool:
        engine = pool.submit(start_engine, tmp / "engine1.log", *engine_flags)
        gateway = pool.submit(start_gateway, tmp / "gateway.log", f"127.0.0.1:{port}", *gateway_flags)
    error = engine.exception() or gateway.exception()
    if error is None:
        return engine.result(), gateway.result()
    for started in (engine, gateway):  # one failed to start: stop the other, then raise
        if started.exception() is None:
            started.result().stop()
    raise error


def result_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def assert_same_answer(got: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Two response bodies are the same answer: equal but for ids, times and cache hits, with logprobs within
    1e-3 (a batch of another shape rounds their last bits differently)."""

    def comparable(body: dict[str, Any]) -> dict[str, Any]:
        usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
        return {"object": body["object"], "model": body["model"], "choices": body["choices"], "usage": usage}

    _assert_close(comparable(got), comparable(expected), where)


def _assert_close(got: Any, expected: Any, where: str) -> None:
    if isinstance(expected, float) and isinstance(got, float):
        assert abs(got - expected) <= 1e-3, f"{where}: {got} != {expected}"
    elif isinstance(expected, dict) and isinstance(got, dict):
        assert got.keys() == expected.keys(), f"{where}: keys {sorted(got)} != {sorted(expected)}"
        for key in expected:
            _assert_close(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list) and isinstance(got, list):
        assert len(got) == len(expected), f"{where}: {len(got)} items != {len(expected)}"
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            _assert_close(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


# -- files ---------------------------------------------------------------------------------------------------


def test_files_round_trip(client: openai.OpenAI, tmp_path: Path) -> None:
    data = b'{"hello": "world"}\n'
    (tmp_path / "notes.jsonl").write_bytes(data)
    with (tmp_path / "notes.jsonl").open("rb") as f:
        created = client.files.create(file=f, purpose="batch")
    with (tmp_path / "notes.jsonl").open("rb") as f:
        other = client.files.create(file=f, purpose="assistants")
    assert created.object == "file" and created.bytes == len(data) and created.filename == "notes.jsonl"
    assert created.purpose == "batch" and created.id.startswith("file-") and created.id != other.id
    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).content == data

    newest = client.files.list(limit=1)
    assert [f.id for f in newest.data] == [other.id] and newest.has_more
    assert client.files.list(limit=1, after=other.id).data[0].id == created.id
    assert [f.id for f in client.files.list(purpose="assistants", limit=100).data][:1] == [other.id]
    oldest_first = [f.id for f in client.files.list(order="asc", limit=10_000).data]
    assert oldest_first.index(created.id) < oldest_first.index(other.id)

    deleted = client.files.delete(other.id)
    assert deleted.deleted and deleted.id == other.id
    for call in (lambda: client.files.retrieve(other.id), lambda: client.files.delete(other.id),
                 lambda: client.files.content(other.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_file_ids_and_names_never_reach_the_file_system(batch_gateway: GatewayProcess, tmp_path: Path) -> None:
    with httpx.Client(base_url=batch_gateway.url, timeout=60) as http:
        reply = http.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("../../../../tmp/escaped.jsonl", b"{}\n")})
        assert reply.status_code == 200 and reply.json()["filename"] == "escaped.jsonl"
        stored = reply.json()["id"]
        for path in ["/v1/files/..%2F..%2Fetc%2Fpasswd", "/v1/files/file-..%2F..%2Fetc%2Fpasswd/content",
                     f"/v1/files/{stored}%2F..%2F..%2Fladle.db/content", "/v1/files/file-XYZ",
                     "/v1/batches/batch_..%2Fx"]:
            answer = http.get(path)
            assert answer.status_code == 404, path
            assert answer.json()["error"]["message"]
    assert not Path("/tmp/escaped.jsonl").exists()
    blob_names = {p.name for p in (batch_gateway.log_path.parent / "data" / "blobs" / "files").iterdir()}
    assert stored in blob_names and all(name.startswith("file-") for name in blob_names)


def test_upload_refusals(batch_gateway: GatewayProcess) -> None:
    with httpx.Client(base_url=batch_gateway.url, timeout=60) as http:
        cases = [
            (http.post("/v1/files", json={"purpose": "batch"}), 400, None),
            (http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}), 400, "purpose"),
            (http.post("/v1/files", data={"purpose": "poetry"}, files={"file": ("a.jsonl", b"{}")}), 400, "purpose"),
            (http.post("/v1/files", data={"purpose": "batch"}), 400, None),  # urlencoded, not multipart
            (http.post("/v1/files", files={"purpose": (None, "batch")}), 400, "file"),
        ]
        for reply, status, param in cases:
            assert reply.status_code == status and reply.json()["error"]["param"] == param, reply.text


def test_uploads_over_the_size_limit_are_refused(engine: EngineProcess, tmp_path: Path) -> None:
    """On a gateway of its own, with a tiny limit and the default store (the database under test plays no part)."""
    tiny = start_gateway(tmp_path / "gateway.log", engine.address, "--max-file-mib", "0.01", "--batch-workers", "0")
    try:
        with httpx.Client(base_url=tiny.url, timeout=60) as http:
            big = b'{"x": "' + b"y" * 20_000 + b'"}\n'
            reply = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", big)})
            assert reply.status_code == 413 and reply.json()["error"]["code"] == "file_too_large"

            def chunked() -> Iterator[bytes]:  # no Content-Length: the cap is enforced while streaming
                yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n'
                for _ in range(100):
                    yield b"z" * 1024
                yield b"\r\n--b--\r\n"

            multipart = {"content-type": "multipart/form-data; boundary=b"}
            reply = http.post("/v1/files", content=chunked(), headers=multipart)
            assert reply.status_code == 413
            assert http.get("/v1/files").json()["data"] == []
        assert list((tmp_path / "data" / "blobs" / "tmp").iterdir()) == []
        assert not (tmp_path / "data" / "blobs" / "files").exists()
    finally:
        tiny.stop()


# -- batches -------------------------------------------------------------------------------------------------


def test_chat_batch_matches_the_synchronous_route(client: openai.OpenAI, model_id: str, tmp_path: Path) -> None:
    bodies = [chat_body(model_id, i, max_tokens=8 + i % 5) for i in range(len(TOPICS))]  # every topic and length
    file_id = upload(client, tmp_path, [line(f"chat-{i}", b) for i, b in enumerate(bodies)])
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                  metadata={"run": "e2e"})
    assert batch.status == "validating" and batch.metadata == {"run": "e2e"} and batch.output_file_id is None
    batch = wait_for(client, batch.id, FINAL)
    assert batch.status == "completed" and batch.errors is None and batch.error_file_id is None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(bodies), len(bodies), 0)
    assert all([batch.in_progress_at, batch.finalizing_at, batch.completed_at])
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = {o["custom_id"]: o for o in result_lines(client, batch.output_file_id)}
    assert sorted(output) == sorted(f"chat-{i}" for i in range(len(bodies)))
    usage_total = 0
    for i, body in enumerate(bodies):
        got = output[f"chat-{i}"]
        assert got["id"].startswith("batch_req_") and got["error"] is None
        assert got["response"]["status_code"] == 200
        direct = client.chat.completions.create(**body).model_dump(mode="json", exclude_unset=True)
        assert_same_answer(got["response"]["body"], direct, f"chat-{i}")
        usage_total += got["response"]["body"]["usage"]["total_tokens"]
    assert batch.usage is not None and batch.usage.total_tokens == usage_total
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_sglang_tutorial_lines_run_to_completed(client: openai.OpenAI, model_id: str, tmp_path: Path) -> None:
    """SGLang's OpenAI-API tutorial writes its lines with "url": "/chat/completions" (no /v1) under a batch for
    /v1/chat/completions; OpenAI's own guide writes /v1/... Both forms run, side by side in one file."""
    requests = [
        {"custom_id": "request-1", "method": "POST", "url": "/chat/completions",
         "body": {"model": model_id, "messages": [{"role": "user", "content": "Tell me a joke about programming"}],
                  "max_tokens": 50}},
        {"custom_id": "request-2", "method": "POST", "url": "/chat/completions",
         "body": {"model": model_id, "messages": [{"role": "user", "content": "What is Python?"}],
                  "max_tokens": 50}},
        line("request-3", chat_body(model_id, 3)),
    ]
    path = tmp_path / "batch_requests.jsonl"
    with path.open("w") as f:
        for req in requests:
            f.write(json.dumps(req) + "\n")
    with path.open("rb") as f:
        file_response = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=file_response.id, endpoint=CHAT, completion_window="24h")
    batch = wait_for(client, batch.id, FINAL)
    assert batch.status == "completed", batch.errors
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
    output = result_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == ["request-1", "request-2", "request-3"]
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in output)


def test_completions_batch_matches_the_synchronous_route(client: openai.OpenAI, model_id: str,
                                                         tmp_path: Path) -> None:
    bodies = [
        {"model": model_id, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
        {"model": model_id, "prompt": ["One, two,", "Red, green,"], "max_tokens": 5, "temperature": 0},
        {"model": model_id, "prompt": [504, 3458, 282], "max_tokens": 4, "temperature": 0, "n": 2},
        {"model": model_id, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "echo": True,
         "stop": ["\n"]},
        {"model": model_id, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2},
    ]
    file_id = upload(client, tmp_path, [line(f"cmpl-{i}", b, COMPLETIONS) for i, b in enumerate(bodies)])
    batch = client.batches.create(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h")
    batch = wait_for(client, batch.id, FINAL)
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies)
    output = {o["custom_id"]: o for o in result_lines(client, batch.output_file_id)}
    for i, body in enumerate(bodies):
        direct = client.completions.create(**body).model_dump(mode="json", exclude_unset=True)
        assert_same_answer(output[f"cmpl-{i}"]["response"]["body"], direct, f"cmpl-{i}")


def test_lines_the_engine_refuses_go_to_the_error_file(client: openai.OpenAI, model_id: str,
                                                       tmp_path: Path) -> None:
    items = [line("fine", chat_body(model_id, 0, 4)),
             line("too-long", {**chat_body(model_id, 1), "max_tokens": 10_000_000}),
             line("bad-bias", {**chat_body(model_id, 2), "logit_bias": {"99999999": 5}})]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, items), endpoint=CHAT,
                                  completion_window="24h")
    batch = wait_for(client, batch.id, FINAL)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    errors = {e["custom_id"]: e for e in result_lines(client, batch.error_file_id)}
    assert sorted(errors) == ["bad-bias", "too-long"]
    for error in errors.values():
        assert error["response"]["status_code"] == 400 and error["error"] is None
        assert error["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert [o["custom_id"] for o in result_lines(client, batch.output_file_id)] == ["fine"]


def malformed_cases(model: str) -> dict[str, tuple[Iterable[Any], str, int]]:
    """Per case: the lines (the 50,001 of "too many lines" as a generator: built only when uploaded, each as
    short as a chat line gets, since the gateway parses every one of them), the error code and the line it
    names."""
    good = line("a", chat_body(model, 0))
    short = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    return {
        "bad json": ([good, b'{"custom_id": "b", "method": '], "invalid_json_line", 2),
        "no custom_id": ([good, {k: v for k, v in line("b", chat_body(model, 1)).items() if k != "custom_id"}],
                         "missing_custom_id", 2),
        "duplicate custom_id": ([good, line("b", chat_body(model, 1)), line("a", chat_body(model, 2))],
                                "duplicate_custom_id", 3),
        "url mismatch": ([good, line("b", chat_body(model, 1), url=COMPLETIONS)], "invalid_url", 2),
        "wrong method": ([line("b", chat_body(model, 1), method="GET"), good], "invalid_method", 1),
        "bad body": ([good, line("b", {**chat_body(model, 1), "temperature": 7})], "invalid_body", 2),
        "other model": ([good, line("b", {**chat_body(model, 1), "model": "gpt-4o"})], "model_not_found", 2),
        "too many lines": ((line(f"x{i}", short) for i in range(50_001)), "too_many_requests", 50_001),
    }


@pytest.mark.parametrize("case", list(malformed_cases("m")))
def test_malformed_input_fails_the_batch_before_anything_runs(
    client: openai.OpenAI, model_id: str, tmp_path: Path, case: str
) -> None:
    items, code, number = malformed_cases(model_id)[case]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, items), endpoint=CHAT,
                                  completion_window="24h")
    batch = wait_for(client, batch.id, FINAL, timeout=120)
    assert batch.status == "failed" and batch.failed_at and batch.in_progress_at is None
    assert batch.errors is not None and batch.errors.data
    first = batch.errors.data[0]
    assert (first.code, first.line) == (code, number) and first.message
    assert batch.output_file_id is None and batch.request_counts.completed == 0


def test_batch_creation_refusals(client: openai.OpenAI, model_id: str, tmp_path: Path) -> None:
    good = upload(client, tmp_path, [line("a", chat_body(model_id, 0))])
    other = upload(client, tmp_path, [line("a", chat_body(model_id, 0))], purpose="user_data")
    unknown = "file-" + "0" * 32
    refusals: list[tuple[dict[str, Any], type[openai.APIStatusError], str]] = [
        ({"input_file_id": unknown, "endpoint": CHAT}, openai.NotFoundError, "input_file_id"),
        ({"input_file_id": "../../etc/passwd", "endpoint": CHAT}, openai.NotFoundError, "input_file_id"),
        ({"input_file_id": other, "endpoint": CHAT}, openai.BadRequestError, "input_file_id"),
        ({"input_file_id": good, "endpoint": "/v1/moderations"}, openai.BadRequestError, "endpoint"),  # not served
        ({"input_file_id": good, "endpoint": CHAT, "completion_window": "1h"}, openai.BadRequestError,
         "completion_window"),
        ({"input_file_id": good, "endpoint": CHAT, "metadata": {str(i): "v" for i in range(17)}},
         openai.BadRequestError, "metadata"),
    ]
    for fields, error, param in refusals:
        with pytest.raises(error) as raised:
            client.batches.create(**{"completion_window": "24h", **fields})  # type: ignore[arg-type]
        assert raised.value.body["param"] == param, fields  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_" + "0" * 32)


def test_batch_metadata_that_utf8_cannot_hold_is_a_400(client: openai.OpenAI, batch_gateway: GatewayProcess,
                                                        model_id: str, tmp_path: Path) -> None:
    """A lone surrogate ("\\ud800" in the JSON) in metadata was stored, answered 500, and then failed every
    list of batches: a value that validates must be one that can be written back."""
    good = upload(client, tmp_path, [line("a", chat_body(model_id, 0))])
    for metadata in ('{"k": "\\ud800"}', '{"\\udfff": "v"}'):
        body = (f'{{"input_file_id": "{good}", "endpoint": "{CHAT}", "completion_window": "24h", '
                f'"metadata": {metadata}}}')
        reply = httpx.post(batch_gateway.base_url + "/batches", content=body.encode(),
                           headers={"content-type": "application/json"}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "metadata"
    assert client.batches.list(limit=100).data is not None


def test_batches_list_and_metrics(client: openai.OpenAI, model_id: str, batch_gateway: GatewayProcess,
                                  tmp_path: Path) -> None:
    file_id = upload(client, tmp_path, [line("a", chat_body(model_id, 0, 2))])
    made = [client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h") for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [made[2].id, made[1].id] and page.has_more
    assert client.batches.list(limit=1, after=made[1].id).data[0].id == made[0].id
    for batch in made:
        wait_for(client, batch.id, FINAL)
    metrics = httpx.get(batch_gateway.url + "/metrics", timeout=30).text
    assert 'ladle_batches{status="completed"}' in metrics
    assert 'ladle_gateway_batch_lines_total{outcome="completed"}' in metrics
    assert "ladle_gateway_batch_lines_in_flight" in metrics


LONG_LINES = 1000  # far more than run before the cancel (after 10): it stops a batch well under way


def test_cancel_a_long_batch(client: openai.OpenAI, model_id: str, tmp_path: Path) -> None:
    items = [line(f"long-{i}", chat_body(model_id, i, 16)) for i in range(LONG_LINES)]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, items), endpoint=CHAT,
                                  completion_window="24h")
    wait_for(client, batch.id, {"in_progress"}, timeout=60)
    wait_for_completed(client, batch.id, 10)  # well under way: lines done, a window of them in flight
    cancelling = client.batches.cancel(batch.id)
    asked = time.monotonic()
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for(client, batch.id, FINAL, timeout=10)
    print(f"cancelled {time.monotonic() - asked:.2f} s after the request, {batch.request_counts}")
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    output, errors = result_lines(client, batch.output_file_id), result_lines(client, batch.error_file_id)
    counts = batch.request_counts
    assert counts.total == LONG_LINES and 0 < counts.completed == len(output) and counts.failed == len(errors) == 0
    assert len({o["custom_id"] for o in output}) == len(output)
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


# -- crashes -------------------------------------------------------------------------------------------------


# The crash comes once CRASH_DONE lines have committed results: dozens are then in flight and about a hundred not
# yet read (on the shared engine, over a second of work). An engine of the test's own gets ENGINE_CRASH_LINES: 20
# unread beside the 32 in flight (twice its --max-num-seqs), seconds of work for an engine this fresh.
CRASH_LINES, CRASH_DONE, ENGINE_CRASH_LINES = 120, 12, 64
# An engine holds batch rows back for interactive latency for 5 s after an interactive request, its own warm-up
# included, in small steps that cost more CPU: the tests' own engines, with nothing interactive to wait for, don't.
UNCAPPED = ("--batch-step-target", "0")
HEALTH_FLAGS = ("--health-interval", "0.25")  # an engine is seen serving (again) at most 0.25 s after it is


def crash_batch(client: openai.OpenAI, model: str, tmp: Path, n: int = CRASH_LINES) -> str:
    items = [line(f"crash-{i}", chat_body(model, i, 6)) for i in range(n)]
    return client.batches.create(input_file_id=upload(client, tmp, items), endpoint=CHAT,
                                 completion_window="24h").id


def assert_each_line_once(client: openai.OpenAI, batch_id: str, n: int = CRASH_LINES) -> None:
    batch = wait_for(client, batch_id, FINAL, timeout=300)
    assert batch.status == "completed"
    seen = Counter(r["custom_id"] for r in result_lines(client, batch.output_file_id))
    seen.update(r["custom_id"] for r in result_lines(client, batch.error_file_id))
    assert seen == Counter(f"crash-{i}" for i in range(n))
    assert (batch.request_counts.completed + batch.request_counts.failed, batch.request_counts.total) == (n, n)


def test_kill_the_gateway_mid_batch(engine: EngineProcess, model_id: str, tmp_path: Path) -> None:
    """On SQLite, a restarted gateway resumes the batch (on PostgreSQL, another replica does: below)."""
    flags = ["--data-dir", str(tmp_path / "data"), "--batch-lease", "3", *HEALTH_FLAGS]
    first = start_gateway(tmp_path / "first.log", engine.address, *flags)
    client = openai.OpenAI(base_url=first.base_url, api_key="unused", max_retries=0, timeout=60)
    batch_id = crash_batch(client, model_id, tmp_path)
    wait_for_completed(client, batch_id, CRASH_DONE)
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait()
    second = start_gateway(tmp_path / "second.log", engine.address, *flags)
    try:
        client = openai.OpenAI(base_url=second.base_url, api_key="unused", max_retries=0, timeout=60)
        assert_each_line_once(client, batch_id)
        assert "batch claimed" in second.log()
    finally:
        assert second.stop() == 0


def test_kill_the_engine_mid_batch(backend: Backend, tmp_path: Path) -> None:
    """The engine dies and comes back: lines in flight are sent again, and each lands once."""
    flags = ("--port", str(free_port()), "--max-num-seqs", "16", *UNCAPPED)
    engine, gateway = start_engine_and_gateway(tmp_path, flags, *backend(), "--data-dir", str(tmp_path / "data"),
                                               *HEALTH_FLAGS)
    try:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)
        batch_id = crash_batch(client, client.models.list().data[0].id, tmp_path, ENGINE_CRASH_LINES)
        wait_for_completed(client, batch_id, CRASH_DONE)
        os.kill(engine.process.pid, signal.SIGKILL)
        engine.process.wait()
        wait_for_log(gateway, "batch call failed; sending its lines again")  # the lines in flight are lost
        assert client.batches.retrieve(batch_id).status == "in_progress"  # and the batch waits for an engine
        engine = start_engine(tmp_path / "engine2.log", *flags)
        assert_each_line_once(client, batch_id, ENGINE_CRASH_LINES)
    finally:
        assert gateway.stop() == 0
        engine.stop()


def test_a_draining_engines_aborted_lines_run_again(tmp_path: Path) -> None:
    """SIGTERM with a short shutdown timeout: the engine aborts the lines it still runs (finish reason ABORT).
    Those are not results: they run again on the restarted engine, and no output line says "abort"."""
    flags = ("--port", str(free_port()), "--max-num-seqs", "8", "--shutdown-timeout", "0.2", *UNCAPPED)
    engine, gateway = start_engine_and_gateway(tmp_path, flags, "--data-dir", str(tmp_path / "data"), *HEALTH_FLAGS)
    n = 24  # 3 rounds of 8: some done before the drain, 8 running when it aborts them, more still unread
    try:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        items = [line(f"crash-{i}", {**chat_body(model, i, 40), "ignore_eos": True}) for i in range(n)]
        batch_id = client.batches.create(input_file_id=upload(client, tmp_path, items), endpoint=CHAT,
                                         completion_window="24h").id
        wait_for_completed(client, batch_id, 4)
        engine.process.send_signal(signal.SIGTERM)
        assert engine.process.wait(60) == 0
        assert "abort" in (tmp_path / "engine1.log").read_text().lower()
        engine = start_engine(tmp_path / "engine2.log", *flags)
        assert_each_line_once(client, batch_id, n)
        batch = client.batches.retrieve(batch_id)
        reasons = Counter(o["response"]["body"]["choices"][0]["finish_reason"]
                          for o in result_lines(client, batch.output_file_id))
        assert reasons == Counter({"length": n})
    finally:
        assert gateway.stop() == 0
        engine.stop()


def test_two_gateways_on_postgresql_share_files_and_batches(engine: EngineProcess, model_id: str, postgres: Any,
                                                            tmp_path: Path) -> None:
    """Two replicas on one PostgreSQL database and one blob directory: either serves any file or batch call,
    and when the one running a batch is killed, the other resumes it (after the lease) to every line once."""
    flags = ["--database-url", postgres.new_database(), "--data-dir", str(tmp_path / "shared"),
             "--batch-lease", "3", *HEALTH_FLAGS]
    with ThreadPoolExecutor(2) as pool:
        gateways = list(pool.map(lambda i: start_gateway(tmp_path / f"replica-{i}.log", engine.address, *flags),
                                 range(2)))
    clients = [openai.OpenAI(base_url=g.base_url, api_key="unused", max_retries=0, timeout=60) for g in gateways]
    try:
        file_id = upload(clients[0], tmp_path, [line("x", chat_body(model_id, 0))])
        assert clients[1].files.retrieve(file_id).id == file_id
        assert clients[1].files.content(file_id).read() == clients[0].files.content(file_id).read()
        batch_id = crash_batch(clients[1], model_id, tmp_path)
        wait_for_completed(clients[0], batch_id, CRASH_DONE)
        runner = next(i for i, g in enumerate(gateways) if "batch claimed" in g.log())
        os.kill(gateways[runner].process.pid, signal.SIGKILL)
        gateways[runner].process.wait()
        survivor = 1 - runner
        assert_each_line_once(clients[survivor], batch_id)
        assert "batch claimed" in gateways[survivor].log()
        assert batch_id in {b.id for b in clients[survivor].batches.list()}
    finally:
        for gateway in gateways:
            if gateway.process.poll() is None:
                assert gateway.stop() == 0
