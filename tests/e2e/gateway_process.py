"""Start and stop a real `ladle gateway` (or `ladle serve`) process on a free loopback port, for the e2e tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.engine_process import EngineProcess, stop_process
from tests.e2e.launcher import Process, launch

STARTUP_TIMEOUT_S = 240.0


@dataclass
class GatewayProcess:
    process: Process  # a subprocess.Popen, or the test launcher's like of one
    url: str  # http://127.0.0.1:PORT (no /v1)
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        return stop_process(self.process, timeout)


def _env() -> dict[str, str]:
    return {**os.environ, "LADLE_LOG_FORMAT": "json", "LADLE_LOG_LEVEL": "INFO", "NO_PROXY": "*"}


def start_gateway(log_path: Path, engines: str, *extra_args: str, wait_healthy: bool = True) -> GatewayProcess:
    """Start `ladle gateway` in front of `engines`; wait until /health is 200 unless `wait_healthy` is False."""
    command = [sys.executable, "-m", "ladle_cli", "gateway", "--engine", engines, "--host", "127.0.0.1",
               "--port", "0", *extra_args]
    gateway = _start(command, log_path, "ladle gateway: OpenAI API on ")
    if wait_healthy:
        wait_until_healthy(gateway)
    return gateway


def start_serve(log_path: Path, *extra_args: str, new_session: bool = False) -> tuple[GatewayProcess, list[str]]:
    """Start `ladle serve` (engine + gateway) on free ports; returns it once it printed "ready", and its lines.
    `new_session`: in a session (and process group) of its own, for tests that signal the group."""
    grpc_port = free_port()
    command = [sys.executable, "-m", "ladle_cli", "serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
               "--grpc-port", str(grpc_port), "--kv-cache-mib", "512", *extra_args]
    lines: list[str] = []
    gateway = _start(command, log_path, "ladle serve: gateway (OpenAI API) on ", lines, new_session)
    assert gateway.process.stdout is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = gateway.process.stdout.readline()
        lines.append(line)
        if line.startswith("ladle serve: ready") or not line:
            break
    return gateway, lines


def _start(
    command: list[str], log_path: Path, marker: str, lines: list[str] | None = None, new_session: bool = False
) -> GatewayProcess:
    if "--data-dir" not in command:  # never the user's own ~/.local/share/ladle
        command = [*command, "--data-dir", str(log_path.parent / "data")]
    log_file = log_path.open("w")
    process = launch(command, stdout=subprocess.PIPE, stderr=log_file, env=_env(), start_new_session=new_session)
    log_file.close()
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if lines is not None:
            lines.append(line)
        if marker in line:
            url = line.split(marker, 1)[1].split()[0].removesuffix("/v1")
            return GatewayProcess(process, url, log_path)
        if not line:
            process.kill()
            raise RuntimeError(f"{command[3]} did not report its address\n{log_path.read_text()}")


def wait_until_healthy(gateway: GatewayProcess, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Poll /health ten times a second on one client (a client per poll builds an SSL context each time: ~40 ms
    of CPU, for as long as the gateway waits for its engine to load)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(gateway.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    gateway.stop(5)
    raise TimeoutError(f"the gateway was not healthy within {timeout} s\n{gateway.log()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def serve_scripted(
    root: Path, template: Any, scripts: dict[str, tuple[str, ...]]
) -> Iterator[tuple[str, EngineProcess, GatewayProcess, Any]]:
    """A scripted model (tests/scripted.py) with `template` (a tests.chat_templates.FamilyTemplate) and `scripts`
    saved under `root`, served on its float path by `ladle engine` behind the gateway: (model id, engine, gateway,
    an official OpenAI client of the gateway). Both processes must stop cleanly at the end."""
    import openai

    from tests.e2e.engine_process import start_engine, wait_until_serving
    from tests.scripted import save_scripted_model

    t = template
    folder = save_scripted_model(root / "model", t.template, scripts, t.special_tokens, t.bos, t.eos, t.stops)
    # The gateway starts while the engine loads its model (its port is bound first): the two start-ups overlap.
    engine = start_engine(root / "engine.log", "--model", str(folder), "--quantization", "none", threads=1, wait=False)
    gateway = start_gateway(root / "gateway.log", engine.address, wait_healthy=False)
    wait_until_serving(engine)
    wait_until_healthy(gateway)
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client.models.list().data[0].id, engine, gateway, client
    assert gateway.stop() == 0 and engine.stop() == 0
