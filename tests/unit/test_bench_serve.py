"""The serving benchmark: its metric arithmetic on hand-made timings, its workloads and arrivals, and a whole
run against a small fake OpenAI-compatible SSE server on loopback (a fake of the server, since what is under
test is the benchmark client: its timing, counting, failure handling and pacing)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from benchmarks import serve
from benchmarks.serve_metrics import RequestOutput, compute_metrics, format_table, summarize_ms

# --- metrics ---------------------------------------------------------------------------------------------


def test_tpot_excludes_the_first_token_and_needs_two() -> None:
    out = RequestOutput(True, output_tokens=5, ttft=0.1, itl=(0.05,) * 4, e2el=0.3)
    assert out.tpot == pytest.approx(0.05)
    assert RequestOutput(True, output_tokens=1, ttft=0.1, e2el=0.1).tpot is None


def test_summary_is_mean_median_and_interpolated_p99_in_ms() -> None:
    stats = summarize_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats == {"mean": 50.5, "median": 50.5, "p99": 99.01}
    assert summarize_ms([]) == {"mean": None, "median": None, "p99": None}


def test_metrics_count_only_successes_and_pool_inter_token_gaps() -> None:
    outputs = [
        RequestOutput(True, prompt_tokens=10, output_tokens=3, ttft=0.2, itl=(0.1, 0.3), e2el=0.6),
        RequestOutput(True, prompt_tokens=10, output_tokens=2, ttft=0.4, itl=(0.2,), e2el=0.6),
        RequestOutput(True, prompt_tokens=10, output_tokens=1, ttft=0.5, e2el=0.5),
        RequestOutput(False, error="HTTP 500: boom"),
    ]
    metrics = compute_metrics(outputs, duration=2.0)
    assert (metrics["completed"], metrics["failed"]) == (3, 1)
    assert (metrics["total_input_tokens"], metrics["total_output_tokens"]) == (30, 6)
    assert metrics["request_throughput"] == 1.5
    assert metrics["output_throughput"] == 3.0 and metrics["total_token_throughput"] == 18.0
    assert metrics["ttft_ms"]["mean"] == pytest.approx(366.667) and metrics["ttft_ms"]["median"] == 400.0
    assert metrics["itl_ms"]["mean"] == pytest.approx(200.0) and metrics["itl_ms"]["median"] == 200.0
    assert metrics["tpot_ms"]["mean"] == pytest.approx(200.0)  # (0.4 / 2 + 0.2 / 1) / 2; one-token request left out
    assert metrics["e2el_ms"]["p99"] == pytest.approx(600.0)
    table = format_table(metrics)
    assert "Successful requests:" in table and "P99 ITL (ms):" in table


# --- workloads and arrivals -------------------------------------------------------------------------------


def test_random_workload_is_seeded_and_stays_in_the_safe_id_range() -> None:
    requests = serve.random_requests(4, input_len=16, output_len=8, vocab_size=5000, seed=1)
    assert requests == serve.random_requests(4, input_len=16, output_len=8, vocab_size=5000, seed=1)
    for r in requests:
        assert r.path == "/completions" and len(r.body["prompt"]) == 16
        assert all(1000 <= i < 4000 for i in r.body["prompt"])
        assert r.body["max_tokens"] == 8 and r.body["ignore_eos"] is True
        assert r.body["stream"] is True and r.body["stream_options"] == {"include_usage": True}


def test_chat_workload_alternates_roles_ends_with_the_user_and_has_about_input_len_words() -> None:
    requests = serve.chat_requests(12, input_len=30, output_len=8, seed=2)
    assert len({json.dumps(r.body["messages"]) for r in requests}) == 12
    assert len({len(r.body["messages"]) for r in requests}) > 1  # 1, 3 or 5 messages
    for r in requests:
        roles = [m["role"] for m in r.body["messages"]]
        assert roles[::2] == ["user"] * len(roles[::2]) and roles[-1] == "user"
        assert "assistant" not in roles[::2] and set(roles[1::2]) <= {"assistant"}
        assert sum(len(m["content"].split()) for m in r.body["messages"]) == 30


def test_poisson_arrivals_start_at_zero_with_mean_gap_one_over_rate() -> None:
    assert serve.arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    offsets = serve.arrival_offsets(4000, 10.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(0.1, rel=0.1)
    assert offsets == serve.arrival_offsets(4000, 10.0, seed=0)


# --- a whole run against a fake server --------------------------------------------------------------------


@dataclass
class FakeState:
    """What the fake server does and saw; read by the test only after the benchmark's run has ended."""

    delay: float = 0.01  # seconds before each content chunk
    fail_every: int = 0  # every n-th request (counting from 1, warm-ups included) gets HTTP 500
    count: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event)}\n\n"


def fake_app(state: FakeState) -> FastAPI:
    """/v1/models, and streamed /v1/completions and /v1/chat/completions of `max_tokens` one-word chunks."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def generate(request: Request, chat: bool) -> Response:
        body = await request.json()
        state.count += 1
        state.arrivals.append(time.perf_counter())
        state.bodies.append(body)
        if state.fail_every and state.count % state.fail_every == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        prompt_tokens = (sum(len(m["content"].split()) for m in body["messages"]) if chat else len(body["prompt"]))

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            content = {"delta": {"content": text}} if chat else {"text": text}
            return {"index": 0, **content, "finish_reason": finish}

        async def events() -> AsyncIterator[str]:
            try:
                if chat:  # a role announcement carries no token, so it must not stop the TTFT clock
                    yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(state.delay)
                    yield _sse({"choices": [choice(f"w{i} ")]})
                yield _sse({"choices": [choice("", "length")]})
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
                yield _sse({"choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeState]]:
    """A fake server on a free loopback port, serving in a thread: yields its base URL and its state."""
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", state
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(autouse=True)
def _no_git(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "git_commit", lambda: "0123abc")


def test_random_run_counts_failures_and_holds_the_concurrency_cap(
    fake_server: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, state = fake_server
    state.fail_every = 3  # the warm-up is request 1; of the 7 timed (2..8), requests 3 and 6 fail
    out = tmp_path / "serve.jsonl"
    argv = ["--base-url", base_url, "--num-prompts", "7", "--input-len", "12", "--output-len", "4",
            "--max-concurrency", "2", "--out", str(out)]
    assert serve.main(argv) == 0
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["benchmark"] == "serve" and result["commit"] == "0123abc" and result["dataset"] == "random"
    assert result["model"] == "fake-model" and result["base_url"] == base_url
    assert result["command"].startswith("ladle bench serve --base-url")
    assert result["workload"]["max_concurrency"] == 2 and result["workload"]["request_rate"] is None
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (5, 2)
    assert len(result["errors"]) == 2 and result["errors"][0].startswith("HTTP 500")
    assert (metrics["total_input_tokens"], metrics["total_output_tokens"]) == (5 * 12, 5 * 4)
    assert metrics["output_throughput"] > 0 and metrics["total_token_throughput"] > metrics["output_throughput"]
    assert metrics["ttft_ms"]["mean"] >= 10 and metrics["itl_ms"]["median"] >= 10  # the fake's delay
    assert metrics["e2el_ms"]["mean"] >= metrics["ttft_ms"]["mean"] and metrics["tpot_ms"]["p99"] is not None
    assert state.max_in_flight == 2
    assert all(b["model"] == "fake-model" and b["ignore_eos"] is True for b in state.bodies)
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_chat_run_follows_the_poisson_schedule_and_times_content_chunks_only(
    fake_server: tuple[str, FakeState], tmp_path: Path
) -> None:
    base_url, state = fake_server
    rate, num = 20.0, 6
    out = tmp_path / "serve.jsonl"
    argv = ["--base-url", base_url, "--dataset", "chat", "--num-prompts", str(num), "--input-len", "10",
            "--output-len", "3", "--request-rate", str(rate), "--num-warmups", "0", "--seed", "5", "--out", str(out)]
    assert serve.main(argv) == 0
    expected = serve.arrival_offsets(num, rate, seed=5)
    observed = [t - state.arrivals[0] for t in state.arrivals]
    # Sent no earlier than scheduled (a loaded CPU can only make them later), and not much later.
    assert all(o >= e - 0.05 for o, e in zip(observed, expected, strict=True))
    assert observed[-1] == pytest.approx(expected[-1], abs=0.25)
    assert all(len(b["messages"]) % 2 == 1 for b in state.bodies)
    result = json.loads(out.read_text())
    assert result["dataset"] == "chat" and result["workload"]["request_rate"] == rate
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["total_input_tokens"], metrics["total_output_tokens"]) == (num, 60, 18)
    assert metrics["ttft_ms"]["median"] >= 10  # the role chunk, sent at once, did not count as the first token


def test_an_unreachable_server_fails_every_request_and_exits_1(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "serve.jsonl"
    argv = ["--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--num-prompts", "3",
            "--num-warmups", "0", "--out", str(out)]
    assert serve.main(argv) == 1
    result = json.loads(out.read_text())
    assert (result["metrics"]["completed"], result["metrics"]["failed"]) == (0, 3)
    assert result["metrics"]["ttft_ms"]["mean"] is None and result["errors"][0].startswith("ConnectError")
