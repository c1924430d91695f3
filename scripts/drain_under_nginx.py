"""Engines drained and restarted in turn behind nginx while callers open new connections as fast as they can:
does a drain (SIGTERM with `--drain-grace`) ever fail a call?

nginx (deploy/nginx/nginx.conf) opens one upstream connection per call and writes the request at once, and it
never sends a gRPC request twice, so a connection the engine drops unread is a failed call (502). The calls are
`grpc.health.v1.Health/Check` through nginx (thousands of new upstream connections a second, where generations
make tens); `--generate-clients` adds generations beside them. Each cycle SIGTERMs one engine, waits for it to
exit, restarts it and waits `--settle-s`. Prints, and appends to `--out`, one JSON line: calls by outcome, every
distinct failure, and nginx's upstream errors other than refused connections (those are retried elsewhere).

    PYTHONPATH=.:clients .venv/bin/python scripts/drain_under_nginx.py --cycles 10 \
        --out benchmarks/results/drain_nginx_cpu.jsonl
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import cpu_model_name, git_commit, report_result, utc_timestamp
from ladle.v1 import engine_pb2_grpc
from tests.e2e.helpers import generate
from tests.e2e.nginx_cluster import Load, nginx_cluster, wait_for_calls


def health_call(channel: grpc.Channel, client: int, i: int) -> None:
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)


def generate_call(channel: grpc.Channel, client: int, i: int) -> None:
    engine_pb2_grpc.EngineServiceStub(channel).Generate(generate(f"Client {client}, question {i}.", 4), timeout=60)


def nginx_upstream_errors(log: str) -> Counter[str]:
    """nginx's error lines by kind (the text between the connection number and ' while'), refused connects
    left out."""
    kinds: Counter[str] = Counter()
    for line in log.splitlines():
        if "[error]" in line and "connect() failed (111" not in line:
            kinds[line.split(": *", 1)[-1].split(" ", 1)[-1].split(" while ", 1)[0]] += 1
    return kinds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--health-clients", type=int, default=16)
    parser.add_argument("--generate-clients", type=int, default=0)
    parser.add_argument("--drain-grace", type=float, default=1.0)
    parser.add_argument("--settle-s", type=float, default=4.0, help="after a restart, before the next drain")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as directory, nginx_cluster(Path(directory), args.drain_grace) as cluster:
        address = cluster.nginx.address
        with Load(address, args.health_clients, health_call) as checks, \
                Load(address, args.generate_clients, generate_call) as generations:
            wait_for_calls(checks, 100)
            for cycle in range(args.cycles):
                index = cycle % 2
                engine = cluster.engines[index]
                engine.process.send_signal(signal.SIGTERM)
                status = engine.process.wait(60)
                assert status == 0, f"engine {index} exited with status {status}"
                cluster.start(index)
                time.sleep(args.settle_s)
                print(f"cycle {cycle}: health {dict(checks.outcomes)}, generate {dict(generations.outcomes)}",
                      file=sys.stderr, flush=True)
        errors = nginx_upstream_errors(cluster.nginx.log_path.read_text())
    failures = Counter(checks.failures) + Counter(generations.failures)
    result: dict[str, Any] = {
        "benchmark": "drain_under_nginx",
        "commit": git_commit(),
        "time": utc_timestamp(),
        "cpu": cpu_model_name(),
        "command": "python scripts/drain_under_nginx.py " + " ".join(argv),
        "cycles": args.cycles,
        "health_calls": dict(checks.outcomes),
        "generate_calls": dict(generations.outcomes),
        "failures": dict(failures),
        "nginx_upstream_errors": dict(errors),
        "seconds": round(time.monotonic() - started, 1),
        "note": args.note,
    }
    report_result(args.out, result)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
