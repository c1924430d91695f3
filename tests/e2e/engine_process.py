"""Start and stop a real `ladle engine` process on a free loopback port, for the end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ladle.client import EngineClient
from tests.e2e.launcher import Process, launch

STARTUP_TIMEOUT_S = 240.0
KV_CACHE_MIB = 512  # the embedded model's 8192-token context needs ~380 MiB; the default 2 GiB is wasteful here


@dataclass
class EngineProcess:
    process: Process  # a subprocess.Popen, or the test launcher's like of one
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        return stop_process(self.process, timeout)


def stop_process(process: Process, timeout: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def exited(process: psutil.Process) -> bool:
    """Whether a process has ended: gone, or dead and waiting to be reaped (an orphan's zombie lingers where the
    container's PID 1 reaps slowly or never; it holds no port and runs nothing)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def still_running(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes that have not ended after up to `timeout` seconds of polling."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in processes if not exited(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def start_engine(
    log_path: Path, *extra_args: str, threads: int | None = None, wait: bool = True
) -> EngineProcess:
    """Start `ladle engine` on a free loopback port (unless `extra_args` name one) and wait until its health is
    SERVING (without `wait`, return once its port is bound, the model still loading: `wait_until_serving` then).
    `threads` caps its torch/OpenMP threads, for tests that run several engines on a few cores."""
    command = [
        sys.executable, "-m", "ladle_cli", "engine", "--model", "default", "--device", "cpu",
        "--host", "127.0.0.1", "--port", "0", "--kv-cache-mib", str(KV_CACHE_MIB), *extra_args,
    ]
    env = {**os.environ, "LADLE_LOG_FORMAT": "json", "LADLE_LOG_LEVEL": "INFO"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log_file = log_path.open("w")
    process = launch(command, stdout=subprocess.PIPE, stderr=log_file, env=env)
    log_file.close()
    assert process.stdout is not None
    line = process.stdout.readline()  # printed as soon as the port is bound, before the model loads
    if " on " not in line:
        process.kill()
        raise RuntimeError(f"ladle engine did not report its address: {line!r}\n{log_path.read_text()}")
    engine = EngineProcess(process, line.rsplit(" on ", 1)[1].strip(), log_path)
    if wait:
        wait_until_serving(engine)
    return engine


def wait_until_serving(engine: EngineProcess, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until `engine`'s health is SERVING; RuntimeError (with its log's tail) as soon as it exits instead,
    TimeoutError (after stopping it) when `timeout` passes first."""
    deadline = time.monotonic() + timeout
    with EngineClient(engine.address) as client:
        while True:
            status = engine.process.poll()
            if status is not None:
                raise RuntimeError(f"ladle engine exited with {status} while starting:\n{engine.log()[-4000:]}")
            try:
                client.wait_until_serving(min(2.0, max(deadline - time.monotonic(), 0.0)))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    engine.stop(5)
                    raise
