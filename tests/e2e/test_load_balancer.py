"""gRPC callers through a real L7 load balancer: nginx (deploy/nginx/nginx.conf, `grpc_pass`) in front of two
engines. Generated stubs and grpcurl (reflection included) work through it; an engine stopped with SIGTERM
(`--drain-grace`) under load costs the unary callers no failed call, and neither does its restart (it listens
only once loaded); one killed with SIGKILL fails only the calls it had in flight, explicitly (nginx cannot
resend a streamed gRPC request body), and none after."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import free_port
from tests.e2e.helpers import generate

REPO = Path(__file__).resolve().parents[2]
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
DEPLOY_ENGINES = ("engine-0.ladle-engine:50051", "engine-1.ladle-engine:50051")
DRAIN_GRACE_S = 1.0
CLIENTS = 3


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

    def start(self, index: int) -> EngineProcess:
        self.engines[index] = start_engine(self.directory / f"engine-{index}.log", "--port", str(self.ports[index]),
                                           "--drain-grace", str(DRAIN_GRACE_S), threads=1)
        return self.engines[index]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("load-balancer")
    ports = [free_port(), free_port()]
    engines = [start_engine(directory / f"engine-{i}.log", "--port", str(port), "--drain-grace", str(DRAIN_GRACE_S),
                            threads=1) for i, port in enumerate(ports)]
    nginx = start_nginx(directory / "nginx", [f"127.0.0.1:{port}" for port in ports])
    cluster = Cluster(engines, ports, nginx, directory)
    yield cluster
    nginx.process.send_signal(signal.SIGQUIT)  # graceful
    nginx.process.wait(30)
    for engine in cluster.engines:
        engine.stop(30)


def served_by_each(cluster: Cluster, calls: int) -> None:
    """`calls` unary calls through nginx all succeed."""
    with grpc.insecure_channel(cluster.nginx.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for i in range(calls):
            reply = stub.Generate(generate(f"Say hello to number {i}.", 2), timeout=60)
            assert reply.usage.completion_tokens == 2


def test_stubs_and_grpcurl_through_nginx(cluster: Cluster) -> None:
    served_by_each(cluster, 4)
    local = Path(sys.executable).parent / "grpcurl"
    grpcurl = str(local) if local.exists() else shutil.which("grpcurl")
    assert grpcurl, "grpcurl is not installed: run `make setup`"
    listed = subprocess.run([grpcurl, "-plaintext", cluster.nginx.address, "list"], capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0 and "ladle.v1.EngineService" in listed.stdout.split(), listed.stderr
    data = '{"input": {"text": "The capital of France is"}, "sampling": {"max_tokens": 3, "temperature": 0}}'
    called = subprocess.run([grpcurl, "-plaintext", "-d", data, cluster.nginx.address,
                             "ladle.v1.EngineService/Generate"], capture_output=True, text=True, timeout=60)
    assert called.returncode == 0 and json.loads(called.stdout)["usage"]["completion_tokens"] == 3, called.stderr


class Load:
    """CLIENTS threads making unary calls through nginx until stopped; every outcome counted."""

    def __init__(self, address: str) -> None:
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.failed_at: list[float] = []  # time.monotonic() of each failure
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(address)
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(CLIENTS)]

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
        stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                stub.Generate(generate(f"Client {client} asks question {i}.", 4, ignore_eos=True), timeout=60)
                self.outcomes["ok"] += 1
            except grpc.RpcError as error:
                self.outcomes[error.code().name] += 1
                self.failures.append(f"{error.code().name}: {error.details()}")
                self.failed_at.append(time.monotonic())


def wait_for_calls(load: Load, more: int, timeout: float = 120) -> None:
    target = load.calls() + more
    deadline = time.monotonic() + timeout
    while load.calls() < target:
        assert time.monotonic() < deadline, load.outcomes
        time.sleep(0.05)


def gets_work(engine: EngineProcess, timeout: float = 30) -> bool:
    """Whether `engine` is seen running or queueing a call within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        while time.monotonic() < deadline:
            load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
            if load.running + load.waiting:
                return True
            time.sleep(0.02)
    return False


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_an_engine_stopped_under_load(cluster: Cluster, how: str) -> None:
    stopped = 1
    with Load(cluster.nginx.address) as load:
        wait_for_calls(load, 10)
        engine = cluster.engines[stopped]
        if how == "sigterm":
            engine.process.send_signal(signal.SIGTERM)
            assert engine.process.wait(60) == 0  # drained: grace, then the calls it had, then exit 0
        else:
            engine.process.kill()
            engine.process.wait(30)
        stopped_at = time.monotonic()
        wait_for_calls(load, 20)  # the other engine carries on alone
        restarted = cluster.start(stopped)  # the same port: nginx sends it calls again once fail_timeout passes
        assert gets_work(restarted), "the restarted engine got no calls through nginx"
        wait_for_calls(load, 10)
    assert load.outcomes["ok"] >= 40, load.outcomes
    if how == "sigterm":
        assert not load.failures, (load.outcomes, load.failures[:5])
    else:  # at most the calls in flight on the killed engine (one per client), each an explicit UNAVAILABLE
        assert len(load.failures) <= CLIENTS, (load.outcomes, load.failures)
        assert all(f.startswith("UNAVAILABLE: ") for f in load.failures), load.failures
        assert all(at - stopped_at < 2.0 for at in load.failed_at), "a call failed after the kill was over"
    served_by_each(cluster, 4)
