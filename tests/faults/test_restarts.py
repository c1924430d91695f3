"""`kill -9` of the engine and of the gateway, then a restart: the gateway answers 503 (OpenAI error JSON, at
once, no hang) while its engine is gone, and serves again once the engine is back on its address, without the
gateway being touched; a gateway killed and started again serves at once. (`kill -9` of `ladle serve`:
tests/e2e/test_serve.py; of either process in the middle of a batch: tests/e2e/test_files_batches.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.engine_process import start_engine
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway

pytestmark = pytest.mark.slow

REJOIN_TIMEOUT_S = 60.0


def chat(gateway: GatewayProcess) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)


def kill_9(process_id: int) -> None:
    os.kill(process_id, signal.SIGKILL)


def test_engine_and_gateway_killed_and_restarted(tmp_path: Path) -> None:
    port = free_port()
    engine = start_engine(tmp_path / "engine1.log", "--port", str(port))
    gateway = start_gateway(tmp_path / "gateway1.log", engine.address)
    try:
        assert chat(gateway).status_code == 200

        kill_9(engine.process.pid)
        engine.process.wait()
        asked = time.monotonic()
        reply = chat(gateway)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - asked < 10

        engine = start_engine(tmp_path / "engine2.log", "--port", str(port))
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        while (reply := chat(gateway)).status_code != 200:
            assert reply.status_code == 503 and time.monotonic() < deadline, reply.text
            time.sleep(0.2)
        print(f"serving again {time.monotonic() - asked:.1f} s after the kill (engine restart included)")

        kill_9(gateway.process.pid)
        gateway.process.wait()
        gateway = start_gateway(tmp_path / "gateway2.log", engine.address)
        assert chat(gateway).status_code == 200
    finally:
        gateway.stop()
        engine.stop()
