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
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ladle.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.engine_process import EngineProcess
from tests.e2e.helpers import generate
from tests.e2e.nginx_cluster import Cluster, Load, nginx_cluster, wait_for_calls

DRAIN_GRACE_S = 1.0
CLIENTS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with nginx_cluster(tmp_path_factory.mktemp("load-balancer"), DRAIN_GRACE_S) as cluster:
        yield cluster


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


def generate_call(channel: grpc.Channel, client: int, i: int) -> None:
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    stub.Generate(generate(f"Client {client} asks question {i}.", 4, ignore_eos=True), timeout=60)


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
    with Load(cluster.nginx.address, CLIENTS, generate_call) as load:
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
