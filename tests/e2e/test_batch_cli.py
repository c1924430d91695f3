"""`ladle batch`: an OpenAI batch file run offline against a real engine; interrupted with SIGINT and run again,
every custom_id ends up exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.engine_process import EngineProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def chat_line(i: int, max_tokens: int = 8) -> dict[str, Any]:
    return {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i % 7 + 2}."}],
                     "max_tokens": max_tokens, "temperature": 0}}


def write_input(path: Path, items: list[Any]) -> Path:
    path.write_text("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))
    return path


def batch_command(source: Path, output: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "ladle_cli", "batch", "-i", str(source), "-o", str(output), *flags]


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_interrupted_and_run_again_each_line_once(engine: EngineProcess, tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", [chat_line(i) for i in range(200)])
    output = tmp_path / "out.jsonl"
    command = batch_command(source, output, "--engine", engine.address)
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while (not output.exists() or output.read_text().count("\n") < 40) and time.monotonic() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130, err
    assert "run the same command again" in err
    partial = read_output(output)
    assert 40 <= len(partial) < 200

    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    results = read_output(output)
    assert Counter(r["custom_id"] for r in results) == Counter(f"q{i}" for i in range(200))
    assert results[: len(partial)] == partial  # what was there is kept as it was
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    body = results[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["choices"][0]["message"]["content"]


def test_a_file_with_its_own_engine_and_both_endpoints(tmp_path: Path) -> None:
    items = [chat_line(0, 4), {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                               "body": {"model": MODEL, "prompt": ["Hello", "Bye"], "max_tokens": 3}},
             {**chat_line(1), "body": {**chat_line(1)["body"], "max_tokens": 10**7}}]
    source = write_input(tmp_path / "in.jsonl", items)
    output = tmp_path / "out.jsonl"
    done = subprocess.run(batch_command(source, output, "--model", "default", "--device", "cpu",
                                        "--kv-cache-mib", "512"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = {r["custom_id"]: r for r in read_output(output)}
    assert results["q0"]["response"]["status_code"] == 200
    assert len(results["c"]["response"]["body"]["choices"]) == 2
    assert results["q1"]["response"]["status_code"] == 400  # the engine refused it: an error line, not a crash


def test_sglang_tutorial_lines(engine: EngineProcess, tmp_path: Path) -> None:
    """Lines as SGLang's OpenAI-API tutorial writes them ("url": "/chat/completions") run like /v1 ones."""
    items = [{"custom_id": f"request-{i}", "method": "POST", "url": url,
              "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8}}
             for i, (url, text) in enumerate([("/chat/completions", "Tell me a joke about programming"),
                                              ("/chat/completions", "What is Python?"),
                                              ("/v1/chat/completions", "Hello")])]
    items.append({"custom_id": "c", "method": "POST", "url": "/completions",
                  "body": {"model": MODEL, "prompt": "Once upon", "max_tokens": 4}})
    source = write_input(tmp_path / "batch_requests.jsonl", items)
    output = tmp_path / "out.jsonl"
    done = subprocess.run(batch_command(source, output, "--engine", engine.address), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = {r["custom_id"]: r for r in read_output(output)}
    assert sorted(results) == ["c", "request-0", "request-1", "request-2"]
    assert all(r["response"]["status_code"] == 200 for r in results.values())
    assert results["c"]["response"]["body"]["object"] == "text_completion"


def test_invalid_lines_run_nothing(tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", [chat_line(0), "{broken", {**chat_line(0), "url": "/v1/x"}])
    output = tmp_path / "out.jsonl"
    done = subprocess.run(batch_command(source, output, "--engine", "127.0.0.1:1"), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "LADLE_LOG_LEVEL": "ERROR"})
    assert done.returncode == 2
    assert "line 2: invalid_json_line" in done.stderr and "line 3: invalid_url" in done.stderr
    assert not output.exists()
