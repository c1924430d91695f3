"""`ladle serve` (what `make serve` runs): engine + gateway from one command answer the OpenAI SDK; SIGTERM
stops both with status 0, and a `ladle serve` killed outright takes its engine with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest

from tests.e2e.engine_process import still_running
from tests.e2e.gateway_process import free_port, start_serve

pytestmark = pytest.mark.slow


def chat(base_url: str) -> str | None:
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8,
        )
    return reply.choices[0].message.content


def test_ladle_serve_answers_a_chat_completion(tmp_path: Path) -> None:
    gateway, lines = start_serve(tmp_path / "serve.log")
    try:
        assert any(line.startswith("ladle serve: engine (gRPC") for line in lines), lines
        assert lines[-1].startswith("ladle serve: ready, model SmolLM2-135M-Instruct"), (lines, gateway.log())
        assert chat(gateway.base_url)
    finally:
        assert gateway.stop() == 0, gateway.log()


def test_kill_9_of_serve_leaves_no_process_and_the_ports_free(tmp_path: Path) -> None:
    ports = ["--port", str(free_port()), "--grpc-port", str(free_port())]
    first, _ = start_serve(tmp_path / "first.log", *ports)
    descendants = psutil.Process(first.process.pid).children(recursive=True)
    assert descendants, "ladle serve runs its engine as a child"
    assert chat(first.base_url)
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait()
    killed = time.monotonic()
    alive = still_running(descendants, timeout=10)  # ~0.1 s on an idle machine; CI's load once took 2.4 s
    print(f"every child gone {time.monotonic() - killed:.2f} s after the kill")
    assert not alive, [(p.pid, p.name()) for p in alive]

    second, lines = start_serve(tmp_path / "second.log", *ports)  # the same ports bind again
    try:
        assert lines[-1].startswith("ladle serve: ready"), (lines, second.log())
        assert second.base_url == first.base_url
        assert chat(second.base_url)
    finally:
        assert second.stop() == 0, second.log()


def test_sighup_to_the_process_group_leaves_the_engine_serving(tmp_path: Path) -> None:
    """The gateway reads its keys again on SIGHUP; the engine child, in the same process group, ignores it (a
    `kill -HUP -<pgid>` or a closing terminal used to kill it, and `ladle serve` with it)."""
    gateway, lines = start_serve(tmp_path / "serve.log", new_session=True)
    try:
        assert lines[-1].startswith("ladle serve: ready"), (lines, gateway.log())
        (engine,) = psutil.Process(gateway.process.pid).children()
        os.killpg(gateway.process.pid, signal.SIGHUP)
        time.sleep(2)  # long enough for a default SIGHUP to have ended the engine, and `ladle serve` after it
        assert engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE, gateway.log()
        assert gateway.process.poll() is None, gateway.log()
        assert chat(gateway.base_url)
    finally:
        assert gateway.stop() == 0, gateway.log()
