"""Two real `ladle engine` processes behind a real nginx (deploy/nginx/nginx.conf, `grpc_pass`), and threads
calling through it until stopped, every outcome counted: for tests/e2e/test_load_balancer.py and
scripts/drain_under_nginx.py."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import free_port

REPO = Path(__file__).resolve().parents[2]
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
DEPLOY_ENGINES = ("engine-0.ladle-engine:50051", "engine-1.ladle-engine:50051")

Call = Callable[[grpc.Channel, int, int], None]  # (channel, client, its call number): one call, raising RpcError


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    assert found, "nginx is not installed: run `make setup` (it installs Debian's nginx-light)"
    return found


@dataclass
class Nginx:
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path


def start_nginx(directory: Path, engines: list[str]) -> Nginx:
    """nginx with the deploy config, its engine addresses and listen port replaced by ours; checked with
    `nginx -t` first."""
    port = free_port()
    conf = NGINX_CONF.read_text().replace("listen 8081 http2;", f"listen 127.0.0.1:{port} http2;")
    for deployed, ours in zip(DEPLOY_ENGINES, engines, strict=True):
        conf = conf.replace(deployed, ours)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    (directory / "nginx.conf").write_text(conf)
    command = [nginx_binary(), "-p", str(directory), "-c", str(directory / "nginx.conf"), "-e", "stderr",
               "-g", f"daemon off; pid {directory / 'nginx.pid'};"]
    checked = subprocess.run([*command, "-t"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    log_path = directory / "nginx.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    nginx = Nginx(process, f"127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 30
    while True:
        try:
            with grpc.insecure_channel(nginx.address) as channel:
                grpc.channel_ready_future(channel).result(timeout=1)
            return nginx
        except grpc.FutureTimeoutError:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()


@dataclass
class Cluster:
    engines: list[EngineProcess]
    ports: list[int]
    nginx: Nginx
    directory: Path
    drain_grace: float

    def start(self, index: int) -> EngineProcess:
        """(Re)start engine `index` on its port."""
        self.engines[index] = start_engine(self.directory / f"engine-{index}.log", "--port", str(self.ports[index]),
                                           "--drain-grace", str(self.drain_grace), threads=1)
        return self.engines[index]


@contextmanager
def nginx_cluster(directory: Path, drain_grace: float) -> Iterator[Cluster]:
    """Two engines (`--drain-grace`, one torch thread each) behind nginx; all stopped at the end."""
    ports = [free_port(), free_port()]
    engines = [start_engine(directory / f"engine-{i}.log", "--port", str(port), "--drain-grace", str(drain_grace),
                            threads=1) for i, port in enumerate(ports)]
    nginx = start_nginx(directory / "nginx", [f"127.0.0.1:{port}" for port in ports])
    cluster = Cluster(engines, ports, nginx, directory, drain_grace)
    try:
        yield cluster
    finally:
        nginx.process.send_signal(signal.SIGQUIT)  # graceful
        nginx.process.wait(30)
        for engine in cluster.engines:
            engine.stop(30)


class Load:
    """`clients` threads making `call`s through one channel until stopped; every outcome counted."""

    def __init__(self, address: str, clients: int, call: Call) -> None:
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.failed_at: list[float] = []  # time.monotonic() of each failure
        self._call = call
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(address)
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        self._channel.close()

    def calls(self) -> int:
        return sum(self.outcomes.values())

    def _run(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                self._call(self._channel, client, i)
                outcome, failure = "ok", None
            except grpc.RpcError as error:
                outcome, failure = error.code().name, f"{error.code().name}: {error.details()}"
            with self._lock:
                self.outcomes[outcome] += 1
                if failure is not None:
                    self.failures.append(failure)
                    self.failed_at.append(time.monotonic())


def wait_for_calls(load: Load, more: int, timeout: float = 120) -> None:
    target = load.calls() + more
    deadline = time.monotonic() + timeout
    while load.calls() < target:
        assert time.monotonic() < deadline, load.outcomes
        time.sleep(0.05)
