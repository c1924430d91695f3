"""Projects, limits and expiry through the official OpenAI SDK against real gateway processes (in front of the fake
engine of tests/unit/fake_engine.py, served from a thread of this process): two projects' keys never see each
other's files or batches, the keys file is read again on SIGHUP, the per-project limits answer OpenAI errors,
expiry policies show in the objects, and the sweeper deletes an expired file but not one a batch still reads."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.gateway_process import GatewayProcess, start_gateway
from tests.unit.fake_engine import MODEL, FakeEngine, start_fake_engine

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
FINAL = {"completed", "failed", "cancelled", "expired"}
KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
MAIN_KEY = "sk-main"  # --api-key: the default project


@pytest.fixture(scope="module")
def fake_engine() -> Iterator[str]:
    """The fake engine's address; it answers each line after 20 ms."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    served: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        served["server"], served["address"] = loop.run_until_complete(start_fake_engine(FakeEngine(delay_s=0.02)))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="fake-engine", daemon=True)
    thread.start()
    assert ready.wait(30)
    yield served["address"]
    asyncio.run_coroutine_threadsafe(served["server"].stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


Backend = Callable[[], list[str]]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "sqlite":
        return list
    server = request.getfixturevalue("postgres")
    return lambda: ["--database-url", server.new_database()]


def write_keys(path: Path, keys: dict[str, str]) -> Path:
    path.write_text("# key project\n\n" + "".join(f"{key} {project}\n" for key, project in keys.items()))
    return path


def gateway_with_keys(tmp: Path, address: str, *flags: str) -> GatewayProcess:
    keys = write_keys(tmp / "keys", KEYS)
    return start_gateway(tmp / "gateway.log", address, "--api-keys-file", str(keys), "--api-key", MAIN_KEY, *flags)


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=60)


def upload(sdk: openai.OpenAI, tmp: Path, n: int = 3, **options: Any) -> Any:
    path = tmp / f"in-{time.monotonic_ns()}.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}]}}) + "\n" for i in range(n)))
    with path.open("rb") as f:
        return sdk.files.create(file=f, purpose="batch", **options)


def wait_for(sdk: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := sdk.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.1)
    return batch


def assert_not_found(call: Callable[[], object], code: str, param: str | None = None) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        call()
    error = raised.value.body
    assert isinstance(error, dict) and error["code"] == code and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"].startswith("No such ")


def assert_hidden(other: openai.OpenAI, file_ids: list[str], batch_id: str) -> None:
    """`other` lists none of the files and the batch, and every call on them is answered 404."""
    assert not set(file_ids) & {f.id for f in other.files.list()}
    assert batch_id not in {b.id for b in other.batches.list()}
    for file_id in file_ids:
        assert_not_found(lambda: other.files.retrieve(file_id), "file_not_found")  # noqa: B023 (called at once)
        assert_not_found(lambda: other.files.content(file_id), "file_not_found")  # noqa: B023
        assert_not_found(lambda: other.files.delete(file_id), "file_not_found")  # noqa: B023
    assert_not_found(lambda: other.batches.retrieve(batch_id), "batch_not_found")
    assert_not_found(lambda: other.batches.cancel(batch_id), "batch_not_found")
    assert_not_found(lambda: other.batches.create(input_file_id=file_ids[0], endpoint=CHAT, completion_window="24h"),
                     "file_not_found", "input_file_id")


def test_projects_never_see_each_others_files_or_batches(fake_engine: str, backend: Backend, tmp_path: Path) -> None:
    gateway = gateway_with_keys(tmp_path, fake_engine, *backend())
    try:
        alpha, beta, main = (client(gateway, key) for key in ("sk-alpha", "sk-beta", MAIN_KEY))
        source = upload(alpha, tmp_path)
        batch = alpha.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
        done = wait_for(alpha, batch.id, FINAL)
        assert done.status == "completed" and done.output_file_id is not None
        assert done.usage is not None and done.usage.input_tokens == sum(len(f"line {i}") for i in range(3))
        assert (done.usage.output_tokens, done.usage.total_tokens) == (3, done.usage.input_tokens + 3)
        assert alpha.files.content(done.output_file_id).text.count("\n") == 3
        own_file = upload(beta, tmp_path)

        for other in (beta, main):
            assert_hidden(other, [source.id, done.output_file_id], batch.id)
        assert {f.id for f in beta.files.list()} == {own_file.id}
        assert {f.id for f in alpha.files.list()} == {source.id, done.output_file_id}
        assert alpha.files.retrieve(source.id).id == source.id  # the refused deletes deleted nothing
        # An unknown id gets the very same answer as another project's.
        assert_not_found(lambda: beta.files.retrieve("file-" + "0" * 32), "file_not_found")
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            reply = http.get(f"/v1/files/{source.id}", headers={"Authorization": "Bearer sk-gamma"})
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    finally:
        assert gateway.stop() == 0


def test_the_keys_file_is_read_again_on_sighup(fake_engine: str, tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys", {"sk-alpha": "alpha"})
    gateway = start_gateway(tmp_path / "gateway.log", fake_engine, "--api-keys-file", str(keys))

    def status(key: str) -> int:
        return httpx.get(gateway.url + "/v1/files", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    def hang_up_until(done: Callable[[], bool]) -> None:
        os.kill(gateway.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not done():
            assert time.monotonic() < deadline, gateway.log()
            time.sleep(0.05)

    try:
        assert (status("sk-alpha"), status("sk-beta")) == (200, 401)
        write_keys(keys, {"sk-alpha": "alpha", "sk-beta": "beta"})
        hang_up_until(lambda: status("sk-beta") == 200)
        keys.write_text("sk-alpha alpha\nsk-gamma\n")  # line 2 is malformed: the keys in use stay
        hang_up_until(lambda: "API keys not reloaded" in gateway.log())
        assert "line 2" in gateway.log() and (status("sk-alpha"), status("sk-beta"), status("sk-gamma")) == (
            200, 200, 401)
        write_keys(keys, {"sk-beta": "beta"})
        hang_up_until(lambda: status("sk-alpha") == 401)
        assert status("sk-beta") == 200 and gateway.process.poll() is None
    finally:
        assert gateway.stop() == 0


def test_a_malformed_keys_file_stops_the_start_naming_its_line(fake_engine: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# keys\nsk-alpha alpha\nsk-beta beta extra fields\n")
    command = [sys.executable, "-m", "ladle_cli", "gateway", "--engine", fake_engine, "--port", "0",
               "--data-dir", str(tmp_path / "data")]
    started = subprocess.run([*command, "--api-keys-file", str(keys)], capture_output=True, text=True, timeout=120)
    assert started.returncode == 2 and f"{keys}, line 3: expected 'KEY PROJECT'" in started.stderr
    assert "sk-beta" not in started.stderr
    env = {**os.environ, "LADLE_API_KEYS_FILE": str(tmp_path / "missing")}
    started = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert started.returncode == 2 and "cannot read the API keys file" in started.stderr


def test_per_project_limits(fake_engine: str, tmp_path: Path) -> None:
    # No batch workers: batches stay `validating`, unfinished, until cancelled.
    gateway = gateway_with_keys(tmp_path, fake_engine, "--project-max-file-bytes", "1000",
                                "--project-max-active-batches", "2", "--batch-workers", "0")
    try:
        alpha, beta = client(gateway, "sk-alpha"), client(gateway, "sk-beta")
        first = upload(alpha, tmp_path, n=5)
        assert 400 < first.bytes <= 1000
        with pytest.raises(openai.BadRequestError) as refused:
            upload(alpha, tmp_path, n=5)
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "storage_limit_exceeded" and "alpha" in error["message"]
        assert [f.id for f in alpha.files.list()] == [first.id]  # nothing of the refused upload stays
        upload(beta, tmp_path, n=5)  # each project has its own storage

        made = [alpha.batches.create(input_file_id=first.id, endpoint=CHAT, completion_window="24h")
                for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as limited:
            alpha.batches.create(input_file_id=first.id, endpoint=CHAT, completion_window="24h")
        error = limited.value.body
        assert isinstance(error, dict) and error["code"] == "batch_limit_exceeded"
        assert error["type"] == "rate_limit_error"
        assert alpha.batches.cancel(made[0].id).status == "cancelled"
        alpha.batches.create(input_file_id=first.id, endpoint=CHAT, completion_window="24h")

        for batch in alpha.batches.list():
            alpha.batches.cancel(batch.id)
        alpha.files.delete(first.id)
        upload(alpha, tmp_path, n=5)  # room again
    finally:
        assert gateway.stop() == 0


def test_expiry_policies_show_in_files_and_result_files(fake_engine: str, tmp_path: Path) -> None:
    gateway = gateway_with_keys(tmp_path, fake_engine)
    try:
        alpha = client(gateway, "sk-alpha")
        source = upload(alpha, tmp_path, expires_after={"anchor": "created_at", "seconds": 3600})
        assert source.expires_at == source.created_at + 3600
        assert alpha.files.retrieve(source.id).expires_at == source.expires_at
        assert upload(alpha, tmp_path).expires_at is None
        for policy, param in [({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                              ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")]:
            with pytest.raises(openai.BadRequestError) as refused:
                upload(alpha, tmp_path, expires_after=policy)
            assert refused.value.body["param"] == param  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as refused:
                alpha.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h",
                                     output_expires_after=policy)  # type: ignore[arg-type]
            assert refused.value.body["param"] == f"output_{param}"  # type: ignore[index]

        batch = alpha.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h",
                                     output_expires_after={"anchor": "created_at", "seconds": 7200})
        done = wait_for(alpha, batch.id, FINAL)
        output = alpha.files.retrieve(done.output_file_id)
        assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200
        plain = wait_for(alpha, alpha.batches.create(input_file_id=source.id, endpoint=CHAT,
                                                     completion_window="24h").id, FINAL)
        assert alpha.files.retrieve(plain.output_file_id).expires_at is None
    finally:
        assert gateway.stop() == 0


def test_the_sweeper_deletes_expired_files_but_not_a_running_batchs_input(fake_engine: str, tmp_path: Path) -> None:
    gateway = gateway_with_keys(tmp_path, fake_engine, "--file-sweep-interval", "0.2", "--batch-workers", "0")
    try:
        alpha = client(gateway, "sk-alpha")
        policy = {"anchor": "created_at", "seconds": 3600}
        lone, read = upload(alpha, tmp_path, expires_after=policy), upload(alpha, tmp_path, expires_after=policy)
        batch = alpha.batches.create(input_file_id=read.id, endpoint=CHAT, completion_window="24h")
        with sqlite3.connect(tmp_path / "data" / "ladle.db") as db:  # an hour passes
            db.execute("UPDATE ladle_files SET expires_at = expires_at - 3601")
        deadline = time.monotonic() + 30
        while lone.id in {f.id for f in alpha.files.list()}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert_not_found(lambda: alpha.files.content(lone.id), "file_not_found")
        time.sleep(1)  # sweeps enough to have deleted the batch's input, had it been allowed to
        assert alpha.files.content(read.id).text.count("\n") == 3
        assert alpha.batches.cancel(batch.id).status == "cancelled"  # the batch ends: its input goes too
        while read.id in {f.id for f in alpha.files.list()}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "expired files deleted" in gateway.log()
        assert not (tmp_path / "data" / "blobs" / "files" / lone.id).exists()
    finally:
        assert gateway.stop() == 0


def test_metrics_need_the_operators_key(fake_engine: str, tmp_path: Path) -> None:
    """No project's key reads /metrics (every project's load and batches): the default project's `--api-key`
    does, or, once set, only `--metrics-api-key`."""

    def status(gateway: GatewayProcess, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(gateway.url + "/metrics", headers=headers, timeout=30).status_code

    gateway = gateway_with_keys(tmp_path, fake_engine)
    try:
        assert [status(gateway, k) for k in (MAIN_KEY, "sk-alpha", "sk-beta", "sk-gamma", None)] == [
            200, 403, 403, 401, 401]
        reply = httpx.get(gateway.url + "/metrics", headers={"Authorization": "Bearer sk-alpha"}, timeout=30)
        assert reply.json()["error"]["code"] == "permission_denied"
    finally:
        assert gateway.stop() == 0
    (tmp_path / "second").mkdir()
    gateway = gateway_with_keys(tmp_path / "second", fake_engine, "--metrics-api-key", "sk-scraper")
    try:
        assert [status(gateway, k) for k in ("sk-scraper", MAIN_KEY, "sk-alpha", None)] == [200, 403, 403, 401]
        assert "ladle_gateway" in httpx.get(gateway.url + "/metrics", timeout=30,
                                            headers={"Authorization": "Bearer sk-scraper"}).text
        refused = httpx.get(gateway.url + "/v1/files", headers={"Authorization": "Bearer sk-scraper"}, timeout=30)
        assert refused.status_code == 401
    finally:
        assert gateway.stop() == 0
