"""`ladle gateway --drain-grace S`: after SIGTERM /health answers 503 `draining` while requests are still served,
for S seconds; then the gateway stops listening and exits 0. A second signal during the grace stops it at once.
A request still running `--shutdown-timeout` seconds after that is cut."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.engine_process import EngineProcess
from tests.e2e.gateway_process import GatewayProcess, start_gateway

GRACE_S = 15.0  # the calls below must fit in it on a busy two-core CI machine


def wait_until_draining(http: httpx.Client, timeout: float = 10.0) -> None:
    """Until /health answers 503 with the code `draining` (the signal lands asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = http.get("/health")
        if reply.status_code == 503:
            assert reply.json()["error"]["code"] == "draining", reply.text
            return
        assert reply.status_code == 200 and time.monotonic() < deadline, reply.text
        time.sleep(0.05)


@contextmanager
def gateway_with(engine: EngineProcess, tmp_path: Path, *flags: str) -> Iterator[GatewayProcess]:
    """A gateway in front of the shared engine with `flags`, stopped at the end whatever happened."""
    gateway = start_gateway(tmp_path / "gateway.log", engine.address, *flags)
    try:
        yield gateway
    finally:
        gateway.stop()


def refuses(gateway: GatewayProcess) -> bool:
    address = urlsplit(gateway.url)
    try:
        socket.create_connection((address.hostname, address.port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_gateway_serves_through_its_drain_grace_then_exits(engine: EngineProcess, tmp_path: Path) -> None:
    with gateway_with(engine, tmp_path, "--drain-grace", str(GRACE_S)) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            gateway.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            wait_until_draining(http)
            reply = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2})
            assert reply.status_code == 200, reply.text  # served while draining
            assert reply.json()["usage"]["completion_tokens"] == 2
            assert time.monotonic() - signalled < GRACE_S, "the test's calls outlasted the grace: make it longer"
        assert gateway.process.wait(60) == 0, gateway.log()
        assert time.monotonic() - signalled >= GRACE_S - 0.1, "it stopped before its grace ended"
        assert refuses(gateway)


def test_a_second_signal_ends_the_grace(engine: EngineProcess, tmp_path: Path) -> None:
    with gateway_with(engine, tmp_path, "--drain-grace", "300") as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            gateway.process.send_signal(signal.SIGTERM)
            wait_until_draining(http)
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(30) == 0, gateway.log()


def test_a_request_still_running_after_the_shutdown_timeout_is_cut(engine: EngineProcess, tmp_path: Path) -> None:
    with gateway_with(engine, tmp_path, "--shutdown-timeout", "1") as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as reply:
                chunks = reply.iter_lines()
                assert next(chunks).startswith("data: ")  # running
                gateway.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                with pytest.raises(httpx.HTTPError):
                    lines = list(chunks)
                    pytest.fail(f"the stream ended normally after {len(lines)} more lines")
        assert gateway.process.wait(30) == 0, gateway.log()
        assert time.monotonic() - signalled < 20, "it waited for the generation instead of its shutdown timeout"
