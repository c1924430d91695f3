"""One gateway, two real engines: cache-aware routing spreads distinct prompts and keeps a shared prefix on one
engine (whose prefix cache then answers for it), and an engine killed under load costs no non-streaming request,
ends its streams with an explicit error event, and serves again after a restart without touching the gateway."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.gateway_process import GatewayProcess, free_port, start_gateway

SYSTEM = ("You are the help desk of the Tessellate Museum. Visitors ask about opening hours, tickets, the mosaic "
          "collection, guided tours, accessibility and the cafe. Answer in one short, friendly sentence. ") * 6
_ROUTED = re.compile(r'^ladle_gateway_routed_total\{engine="([^"]+)",reason="([^"]+)"\} ([0-9.e+]+)$', re.M)
_UP = re.compile(r'^ladle_engine_up\{engine="([^"]+)"\} ([0-9.]+)$', re.M)
# One HTTP client per thread that sends chats (a client per request built an SSL context each time: ~40 ms of CPU).
_CLIENTS = threading.local()


@dataclass
class Pair:
    engines: list[EngineProcess]
    ports: list[int]
    gateway: GatewayProcess
    directory: Path

    def address(self, index: int) -> str:
        return f"127.0.0.1:{self.ports[index]}"

    def start(self, index: int) -> EngineProcess:
        self.engines[index] = start_engine(self.directory / f"engine-{index}.log", "--port", str(self.ports[index]),
                                           "--max-num-seqs", "8", threads=1)
        return self.engines[index]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("two-engines")
    ports = [free_port(), free_port()]
    pair = Pair([], ports, None, directory)  # type: ignore[arg-type]
    pair.engines = [None, None]  # type: ignore[list-item]
    for index in (0, 1):
        pair.start(index)
    pair.gateway = start_gateway(directory / "gateway.log", f"{pair.address(0)},{pair.address(1)}",
                                 "--health-interval", "0.2", "--batch-workers", "0")
    while sum(up(pair).values()) < 2:
        time.sleep(0.1)
    yield pair
    assert pair.gateway.stop() == 0
    for engine in pair.engines:
        engine.stop(30)


def metrics(pair: Pair) -> str:
    return httpx.get(pair.gateway.url + "/metrics", timeout=30).text


def routed(pair: Pair) -> Counter[tuple[str, str]]:
    return Counter({(engine, reason): int(float(count)) for engine, reason, count in _ROUTED.findall(metrics(pair))})


def up(pair: Pair) -> dict[str, int]:
    return {engine: int(float(value)) for engine, value in _UP.findall(metrics(pair))}


def chat(pair: Pair, content: str, system: str = "", max_tokens: int = 1, **extra: object) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": max_tokens, **extra}
    client = getattr(_CLIENTS, "client", None)
    if client is None:
        client = _CLIENTS.client = httpx.Client(timeout=120)
    return client.post(pair.gateway.url + "/v1/chat/completions", json=body)


def by_engine(counts: Counter[tuple[str, str]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for (engine, _), count in counts.items():
        total[engine] += count
    return total


def test_distinct_prefixes_spread_and_a_shared_prefix_stays_on_one_engine(pair: Pair) -> None:
    before = routed(pair)
    prompts = [f"Visitor {i} of {i * 7919 % 1000} asks: {SYSTEM[:300]}" for i in range(100)]  # a chunk each
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: chat(pair, p), prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:3]
    spread = by_engine(routed(pair) - before)
    assert sum(spread.values()) == 100
    assert min(spread[pair.address(0)], spread[pair.address(1)]) >= 30, spread  # each at least 30%

    before = routed(pair)
    cached = []
    for question in ("When do you open?", "How much is a ticket?", "Is there a cafe?", "Can I bring a pram?",
                     "Are tours in French?", "Where are the mosaics?"):
        reply = chat(pair, question, system=SYSTEM)
        assert reply.status_code == 200, reply.text
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    shared = routed(pair) - before
    assert len(by_engine(shared)) == 1, shared  # every one on the same engine
    assert sum(count for (_, reason), count in shared.items() if reason == "prefix") >= 5, shared
    assert all(tokens >= 128 for tokens in cached[1:]), cached  # the system prompt came from the prefix cache


def stream_events(pair: Pair, content: str) -> list[str]:
    """The data of every event of a streamed chat completion (a broken connection ends the list)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", pair.gateway.url + "/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
    except httpx.HTTPError as exc:
        events.append(f"broken: {exc!r}")
    return events


def test_an_engine_killed_under_load(pair: Pair) -> None:
    killed = 1
    stop = threading.Event()
    outcomes: Counter[int] = Counter()
    failures: list[str] = []

    def load(client: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            reply = chat(pair, f"Client {client}, question {i}: what is on today?", max_tokens=6, ignore_eos=True)
            outcomes[reply.status_code] += 1
            if reply.status_code != 200:
                failures.append(reply.text)

    with ThreadPoolExecutor(7) as pool:
        # The streams go first, one at a time, so the idle engines take them in turn (2 each).
        streams = []
        for i in range(4):
            streams.append(pool.submit(stream_events, pair, f"Story {i}: tell a long tale about a lighthouse."))
            time.sleep(0.3)
        clients = [pool.submit(load, i) for i in range(3)]
        deadline = time.monotonic() + 60
        while sum(outcomes.values()) < 10:
            assert time.monotonic() < deadline, outcomes
            time.sleep(0.05)
        pair.engines[killed].process.kill()
        pair.engines[killed].process.wait(30)
        served = sum(outcomes.values())
        while sum(outcomes.values()) < served + 15:  # the other engine carries on alone
            assert time.monotonic() < deadline + 120, outcomes
            time.sleep(0.05)
        ended = [s.result(timeout=120) for s in streams]

        before = routed(pair)
        pair.start(killed)  # same port; the gateway's poll finds it SERVING
        while up(pair).get(pair.address(killed)) != 1:
            assert time.monotonic() < deadline + 240, "the restarted engine never rejoined"
            time.sleep(0.1)
        while not by_engine(routed(pair) - before)[pair.address(killed)]:
            assert time.monotonic() < deadline + 300, "the restarted engine gets no calls"
            time.sleep(0.1)
        stop.set()
        for client in clients:
            client.result(timeout=120)

    assert not failures and outcomes[200] >= 25, (outcomes, failures[:3])
    errors = [json.loads(e[-1])["error"] for e in ended if e and e[-1] != "[DONE]"]
    finished = [e for e in ended if e and e[-1] == "[DONE]"]
    assert errors, "no stream was on the killed engine"  # the 4 streams were spread over both
    assert len(errors) + len(finished) == 4, ended  # every stream ended explicitly: [DONE] or an error event
    assert all(error["type"] == "service_unavailable_error" for error in errors), errors
